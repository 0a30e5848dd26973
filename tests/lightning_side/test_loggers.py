"""Loggers get checkpoints whole (issue 33, point 1): every checkpoint MLFlowLogger logs is in its store with its
``.data``, downloads into a fresh folder, verifies and resumes; loggers we cannot teach warn at setup. Real stores
only: MLflow's file store in a temporary folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_ort_ckpt import OrtCheckpoint, open_checkpoint
from lightning_ort_ckpt._command._cli import main as ort_ckpt
from lightning_ort_ckpt.errors import CheckpointWarning
from helpers.loggers import Net

mlflow = pytest.importorskip("mlflow")  # the dev extra installs mlflow-skinny
from mlflow.artifacts import download_artifacts  # noqa: E402
from pytorch_lightning.loggers import MLFlowLogger  # noqa: E402


def _fit(logger: Any, dirpath: Path, max_epochs: int, ckpt_path: str | None = None) -> OrtCheckpoint:
    callback = OrtCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2, save_last=True, external_data="all")
    pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=logger, callbacks=[callback],
               enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1).fit(Net(),
                                                                                            ckpt_path=ckpt_path)
    return callback


def _logged_checkpoints(client: Any, run_id: str) -> dict[str, list[str]]:
    """artifact folder -> the names in it, for every folder holding a logged checkpoint."""
    out = {}
    for folder in client.list_artifacts(run_id):
        names = sorted(os.path.basename(f.path) for f in client.list_artifacts(run_id, folder.path))
        if any(n.endswith(".ckpt") for n in names):
            out[folder.path] = names
    return out


@pytest.fixture(autouse=True)
def _file_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's file store (mlflow-skinny has no SQL store), which MLflow 3 keeps behind this switch."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


@pytest.mark.parametrize("log_model", ["all", True])
def test_mlflow_logs_every_checkpoint_whole_and_it_resumes(tmp_path: Path, log_model: Any) -> None:
    """"all" logs after each save, True at the end (finalize, after every callback's teardown)."""
    uri = f"file:{tmp_path / 'mlruns'}"
    logger = MLFlowLogger(experiment_name="whole", tracking_uri=uri, log_model=log_model)
    callback = _fit(logger, tmp_path / "ckpts", max_epochs=3)
    logged = _logged_checkpoints(logger.experiment, logger.run_id)
    expected = {Path(p).stem for p in (*callback.best_k_models, callback.last_model_path)}
    assert expected <= set(logged), logged
    for folder, names in logged.items():  # each logged file has its .data beside it
        ckpts = [n for n in names if n.endswith(".ckpt")]
        assert [n + ".data" for n in ckpts] == [n for n in names if n.endswith(".data")], names
    fresh = tmp_path / "downloaded"
    best = Path(callback.best_model_path)
    local = download_artifacts(run_id=logger.run_id, artifact_path=best.stem, dst_path=str(fresh),
                               tracking_uri=uri)
    path = os.path.join(local, best.name)
    assert ort_ckpt(["verify", path]) == 0
    with open_checkpoint(path) as got, open_checkpoint(best) as saved:
        assert got.has_external_data and torch.equal(got.get_tensor("layer.weight"), saved.get_tensor("layer.weight"))
    resumed = _fit(False, tmp_path / "resumed", max_epochs=4, ckpt_path=path)
    assert Path(resumed.last_model_path).exists()


def test_mlflow_without_log_model_logs_no_checkpoint(tmp_path: Path) -> None:
    uri = f"file:{tmp_path / 'mlruns'}"
    logger = MLFlowLogger(experiment_name="none", tracking_uri=uri, log_model=False)
    _fit(logger, tmp_path / "ckpts", max_epochs=1)
    assert _logged_checkpoints(logger.experiment, logger.run_id) == {}


class _UploadingLogger(pl.loggers.CSVLogger):
    """A logger of the user's own that uploads checkpoints, as Lightning's do (``log_model``)."""

    def __init__(self, save_dir: str) -> None:
        super().__init__(save_dir)
        self._log_model = "all"


def test_a_logger_we_cannot_teach_warns_at_setup(tmp_path: Path) -> None:
    with pytest.warns(CheckpointWarning, match=r"_UploadingLogger\(log_model='all'\) uploads one file per "
                                               r"checkpoint: a checkpoint with a <file>.data"):
        _fit(_UploadingLogger(str(tmp_path / "logs")), tmp_path / "ckpts", max_epochs=1)


def test_wandb_offline_warns_at_setup_that_it_uploads_one_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B logs each checkpoint as an artifact version made and closed inside the logger: we cannot add the .data
    to it without wrapping Lightning's code, so the user is told at setup (a real offline run, files in tmp_path)."""
    pytest.importorskip("wandb")
    from pytorch_lightning.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="whole", save_dir=str(tmp_path), log_model="all")  # offline by WANDB_MODE
    try:
        with pytest.warns(CheckpointWarning, match=r"WandbLogger\(log_model='all'\) uploads one file per checkpoint"):
            _fit(logger, tmp_path / "ckpts", max_epochs=1)
    finally:
        logger.experiment.finish()
