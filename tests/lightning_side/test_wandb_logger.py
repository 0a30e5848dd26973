"""W&B gets whole checkpoints (issue 42, point 3): ``OrtWandbLogger``, passed instead of ``WandbLogger``, logs each
checkpoint as one artifact holding the file and its ``.data``, or a sharded checkpoint's folder (``ModelParallel``);
a checkpoint rebuilt from the files W&B staged verifies and resumes. A real W&B run in offline mode, every file in
``tmp_path``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl

from lightning_ort_ckpt import OrtCheckpoint, OrtWandbLogger
from lightning_ort_ckpt._command._cli import main as ort_ckpt
from lightning_ort_ckpt.errors import CheckpointConfigError, CheckpointWarning
from helpers import forkserver
from helpers.launching import free_port
from helpers.loggers import Net

pytest.importorskip("wandb")  # the dev extra installs it


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))  # where artifacts' files are staged
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def _fit(logger: Any, dirpath: Path, max_epochs: int, ckpt_path: str | None = None,
         **settings: Any) -> OrtCheckpoint:
    callback = OrtCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True, external_data="all",
                             **settings)
    pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=logger, callbacks=[callback],
               enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1).fit(Net(),
                                                                                            ckpt_path=ckpt_path)
    return callback


@pytest.mark.parametrize(("log_model", "async_save"), [("all", False), ("all", True), (True, False)])
def test_every_checkpoint_is_logged_whole_and_resumes(tmp_path: Path, log_model: Any, async_save: bool) -> None:
    logger = OrtWandbLogger(project="whole", save_dir=str(tmp_path), log_model=log_model)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            callback = _fit(logger, tmp_path / "ckpts", max_epochs=3, async_save=async_save)
        assert not [w for w in caught if issubclass(w.category, CheckpointWarning)]  # nothing will be missed
        kept = {*callback.best_k_models, callback.last_model_path}
        assert kept <= set(logger.checkpoint_artifacts)
        for path, artifact in logger.checkpoint_artifacts.items():
            name = os.path.basename(path)
            assert sorted(artifact.manifest.entries) == [name, name + ".data"], path  # the manifest: every file
            assert artifact.type == "model" and artifact.metadata["original_filename"] == name
        # the checkpoint as W&B holds it: its staged files, under their names, in a fresh folder
        best = callback.best_model_path
        fresh = tmp_path / "from-wandb"
        fresh.mkdir()
        for name, entry in logger.checkpoint_artifacts[best].manifest.entries.items():
            shutil.copyfile(entry.local_path, fresh / name)
        rebuilt = fresh / os.path.basename(best)
        assert Path(f"{rebuilt}.data").read_bytes() == Path(f"{best}.data").read_bytes()
        assert ort_ckpt(["verify", str(rebuilt)]) == 0
    finally:
        logger.experiment.finish()
    resumed = _fit(False, tmp_path / "resumed", max_epochs=4, ckpt_path=str(rebuilt))
    assert Path(resumed.last_model_path).exists()


SHARDED = textwrap.dedent('''
    import json, os, shutil, sys
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import ModelParallelStrategy
    from lightning_ort_ckpt import OrtCheckpoint, OrtWandbLogger
    from helpers.loggers import Net

    class Sharded(Net):
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard
            fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

    def fit(logger, dirpath, max_epochs, ckpt_path=None):
        callback = OrtCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True)
        pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, strategy=ModelParallelStrategy(),
                   logger=logger, callbacks=[callback], enable_progress_bar=False, enable_model_summary=False,
                   log_every_n_steps=1).fit(Sharded(), ckpt_path=ckpt_path)
        return callback

    out = sys.argv[1]
    logger = OrtWandbLogger(project="sharded", save_dir=out, log_model="all")
    callback = fit(logger, os.path.join(out, "ckpts"), 3)
    logger.experiment.finish()
    best = callback.best_model_path
    rebuilt = os.path.join(out, "from-wandb")  # the best checkpoint as W&B holds it: its staged files, renamed
    for name, entry in logger.checkpoint_artifacts[best].manifest.entries.items():
        os.makedirs(os.path.dirname(os.path.join(rebuilt, name)), exist_ok=True)
        shutil.copyfile(entry.local_path, os.path.join(rebuilt, name))
    resumed = fit(False, os.path.join(out, "resumed"), 4, ckpt_path=os.path.join(rebuilt, os.path.basename(best)))
    with open(os.path.join(out, "record.json"), "w") as f:
        json.dump({"best": best, "last": callback.last_model_path, "kept": sorted(callback.best_k_models),
                   "manifests": {p: sorted(a.manifest.entries) for p, a in logger.checkpoint_artifacts.items()},
                   "resumed_last": resumed.last_model_path}, f)
''')


def test_a_sharded_checkpoint_is_logged_as_its_whole_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``ModelParallelStrategy`` (one process, gloo) each checkpoint is a folder: its artifact holds every file
    of it, under the folder's name, and the best one, rebuilt from W&B's staged files, verifies and resumes."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    proc = forkserver.spawn(code=SHARDED, args=[str(tmp_path)], cwd=str(tmp_path), merge_stderr=True)
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the ModelParallel fit with OrtWandbLogger hung (over 600 s)")
    assert proc.returncode == 0, output[-3000:]
    record = json.loads((tmp_path / "record.json").read_text())
    assert {*record["kept"], record["last"]} <= set(record["manifests"])
    for path, entries in record["manifests"].items():
        name = os.path.basename(path)
        assert len(entries) >= 2 and all(e.startswith(f"{name}/") for e in entries), (path, entries)
        if path in record["kept"] or path == record["last"]:  # the others were deleted by retention since
            files = sorted(f"{name}/{f}" for f in os.listdir(path) if not f.startswith("."))  # not a pending deletion
            assert entries == files, path  # every file of the checkpoint
    rebuilt = tmp_path / "from-wandb" / os.path.basename(record["best"])
    assert sorted(os.listdir(rebuilt)) == sorted(f for f in os.listdir(record["best"]) if not f.startswith("."))
    assert ort_ckpt(["verify", str(rebuilt)]) == 0
    assert Path(record["resumed_last"]).is_dir()


def test_without_log_model_nothing_is_logged(tmp_path: Path) -> None:
    logger = OrtWandbLogger(project="none", save_dir=str(tmp_path))
    try:
        _fit(logger, tmp_path / "ckpts", max_epochs=1)
        assert logger.checkpoint_artifacts == {}
    finally:
        logger.experiment.finish()


def test_a_wrong_log_model_is_refused() -> None:
    with pytest.raises(CheckpointConfigError, match="log_model must be False, True or 'all'"):
        OrtWandbLogger(project="x", log_model="best")
