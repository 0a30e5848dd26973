"""``fit(ckpt_path="last")`` with sharded checkpoint folders, 2 CPU processes (gloo, ``ModelParallelStrategy``,
FSDP2), launched as users launch them; issue 30's F1 and F2.

One launch, four fits in the same two processes (each rank records what it saw):

* F1, on a real S3 API (moto's server on 127.0.0.1, as in ``test_remote_storage``): fit 1 saves sharded folders at
  steps 2 and 4 into ``s3://.../run``, and rank 0 then leaves a half-written folder (a shard, no metadata) of step
  5 there; fit 2 resumes with ``ckpt_path="last"``: both ranks start at step 4 from the step-4 folder (Lightning's
  own rule asked S3 for the folder's modification time and crashed with ``IsADirectoryError``), and the half
  folder is gone after the next save.
* F2, in a local directory: fit 3 saves folders at steps 2 and 4, then rank 0 flips one byte of a tensor in a shard
  of the step-4 folder; fit 4 resumes with "last": the load fails on the checksum, every rank falls back together
  to the step-2 folder (one collective), warning with the damaged shard file and tensor, and ``trainer.ckpt_path``
  names the step-2 folder. Fit 4 saved steps 4 (as ``-v1``: the damaged folder keeps its name) and 6; rank 0
  deletes a shard file of the step-6 folder, and fit 5 falls back from it (the missing shard named) to the step-4
  save.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers.damage import FLIP_A_SHARD_BYTE
from helpers.launching import SHARDED_NET, launch_script
from helpers.s3 import _s3_env

SCRIPT = r'''
import glob, json, os, sys, warnings
import fsspec
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from pytorch_lightning.strategies import ModelParallelStrategy
from lightning_ort_ckpt import OrtCheckpoint, open_checkpoint


''' + SHARDED_NET + r'''
Net = ShardedNet


class Record(pl.Callback):
    def __init__(self, name, after=None):
        self.name, self.after, self.start = name, after, None

    def on_train_start(self, trainer, pl_module):
        self.start, self.ckpt_path = trainer.global_step, trainer.ckpt_path and str(trainer.ckpt_path)

    def on_fit_end(self, trainer, pl_module):
        if self.after is not None and trainer.is_global_zero:
            self.after(trainer.checkpoint_callback.dirpath)
        trainer.strategy.barrier()
        with open(os.path.join(OUT, f"{self.name}.rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"start": self.start, "ckpt_path": self.ckpt_path, "end": trainer.global_step,
                       "warnings": [str(w.message) for w in CAUGHT]}, f)
        CAUGHT.clear()


def fit(name, dirpath, max_steps, ckpt_path=None, after=None):
    pl.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=2, logger=False,
                         strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                         callbacks=[Record(name, after), OrtCheckpoint(dirpath, every_n_train_steps=2, save_top_k=-1)],
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    trainer.fit(Net(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4), ckpt_path=ckpt_path)


def leave_half_folder(dirpath):
    fs, root = fsspec.core.url_to_fs(dirpath)
    fs.pipe_file(f"{root}/epoch=0-step=5.ckpt/shard-0000000000000000-00000.odtc", b"a save that did not finish")


''' + FLIP_A_SHARD_BYTE + r'''

def flip_a_tensor_byte(dirpath):
    flip_a_shard_byte(os.path.join(dirpath, "epoch=0-step=4.ckpt"))


def remove_a_shard(dirpath):
    os.remove(sorted(glob.glob(os.path.join(dirpath, "epoch=1-step=6.ckpt", "shard-*.odtc")))[-1])


OUT, S3 = sys.argv[1], sys.argv[2]
LOCAL = os.path.join(OUT, "local")
warnings.simplefilter("ignore")
with warnings.catch_warnings(record=True) as CAUGHT:
    warnings.simplefilter("always", UserWarning)
    fit("f1-first", S3, 4, after=leave_half_folder)
    fit("f1-last", S3, 6, ckpt_path="last")
    fit("f2-first", LOCAL, 4, after=flip_a_tensor_byte)
    fit("f2-checksum", LOCAL, 6, ckpt_path="last", after=remove_a_shard)
    fit("f2-missing", LOCAL, 6, ckpt_path="last")
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> tuple[Path, str, list[str]]:  # noqa: F811
    """The one launch; returns its folder, the S3 URL and what is left there."""
    import fsspec
    import uuid

    tmp_path = tmp_path_factory.mktemp("sharded-resume")
    options = {"key": "x", "secret": "y", "client_kwargs": {"endpoint_url": s3_endpoint}}
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("s3", **options)
    fs.mkdir(bucket)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launch_script(script, [str(tmp_path), f"s3://{bucket}/run"], "the sharded resume runs", 600,
                  **_s3_env(s3_endpoint))
    fs.invalidate_cache()
    left = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/run"))
    return tmp_path, f"s3://{bucket}/run", left


def record(tmp_path: Path, name: str, rank: int) -> dict[str, Any]:
    return json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())


def test_f1_last_resumes_a_sharded_folder_on_s3_and_cleans_the_half_folder(runs: tuple[Path, str, list[str]]) -> None:
    tmp_path, url, left = runs
    for rank in (0, 1):
        seen = record(tmp_path, "f1-last", rank)
        assert (seen["start"], seen["end"], seen["ckpt_path"]) == (4, 6, f"{url}/epoch=0-step=4.ckpt"), seen
    assert any("epoch=0-step=5.ckpt: checkpoint folder(s) without checkpoint.ort-meta" in w
               for w in record(tmp_path, "f1-last", 0)["warnings"])
    assert left == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt"]  # the half folder is gone


def test_f2_a_damaged_shard_makes_every_rank_fall_back_together(runs: tuple[Path, str, list[str]]) -> None:
    tmp_path, _, _ = runs
    local = tmp_path / "local"
    for rank in (0, 1):
        seen = record(tmp_path, "f2-checksum", rank)
        assert (seen["start"], seen["ckpt_path"]) == (2, str(local / "epoch=0-step=2.ckpt")), seen
        warned = [w for w in seen["warnings"] if "cannot be resumed from" in w]
        assert len(warned) == 1 and "every rank falls back to" in warned[0], seen["warnings"]
        assert f"{local / 'epoch=0-step=4.ckpt'}/shard-" in warned[0] and "is damaged: its bytes" in warned[0], warned
        assert "parameter or buffer '" in warned[0], warned  # the tensor, by name


def test_f2_a_missing_shard_falls_back_to_the_previous_save(runs: tuple[Path, str, list[str]]) -> None:
    tmp_path, _, _ = runs
    local = tmp_path / "local"
    for rank in (0, 1):
        seen = record(tmp_path, "f2-missing", rank)
        assert (seen["start"], seen["ckpt_path"]) == (4, str(local / "epoch=0-step=4-v1.ckpt")), seen
        warned = [w for w in seen["warnings"] if "cannot be resumed from" in w]
        assert len(warned) == 1 and "named in the checkpoint's checkpoint.ort-meta, is missing" in warned[0], warned
