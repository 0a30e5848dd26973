"""Asynchronous saving (``lightning_ort_ckpt._saving._staging``): bounded, exact, and loud when a copy would be torn.

* every file an asynchronous run writes holds exactly the state of its step (the same bytes as a synchronous run's),
  although the parameters and optimizer state are copied while training runs its next forward and backward pass;
* saves never pile up: with a save at every step and a frozen backbone, peak memory stays within one checkpoint of
  a synchronous run's (measured as VmHWM in fresh processes), and at most one save is queued at any time;
* a parameter changed in place outside ``optimizer.step`` while its copy is pending fails the save loudly, and the
  file is not written;
* an optimizer step given a closure (as Lightning steps) runs the closure's forward and backward pass while the copy
  is pending and waits for it only before its update.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import CheckpointContents, CheckpointSaveError, OrtCheckpoint, OrtCheckpointIO, load_checkpoint
from lightning_ort_ckpt._saving import _staging as staging
from lightning_ort_ckpt.format import _atomic as atomic

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


class Backboned(pl.LightningModule):
    """A frozen backbone (``frozen_mb`` MB of float32), a BatchNorm whose buffers change every step, a trained head."""

    def __init__(self, width: int = 32, frozen_mb: float = 0.0) -> None:
        super().__init__()
        rows = max(1, int(frozen_mb * 2**20 / 4 / width))
        self.backbone = nn.Embedding(rows, width)
        self.backbone.requires_grad_(False)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.norm(x + self.backbone.weight[:1])), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader(width: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, width, generator=g), torch.randn(64, width, generator=g)),
                      batch_size=8)


def fit(dirpath: Path, async_save: bool, max_steps: int = 6, frozen_mb: float = 0.0, **kwargs: Any) -> None:
    pl.seed_everything(0, verbose=False)
    callback = OrtCheckpoint(dirpath, every_n_train_steps=1, save_top_k=-1, async_save=async_save, **kwargs)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[callback], accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Backboned(frozen_mb=frozen_mb), loader())


def tensors_of(ck: Any) -> dict[str, torch.Tensor]:
    """Parameters, buffers and optimizer state by name (not the extras named after file paths, which differ)."""
    out = {n: t for n, t in {**ck.trainable, **ck.frozen}.items() if not n.startswith("lightning:")}
    for g, grp in ck.optimizer_groups.items():
        out.update({f"{g}/{p}/{m}": t for p, ms in grp.states.items() for m, t in ms.items()})
    return out


def folder(where: str, tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """``tmp_path`` (a disk: saves staged), or on a memory file system (saves written from the live tensors)."""
    return tmp_path if where == "disk" else request.getfixturevalue("memory_folder")


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_async_files_hold_exactly_their_step(tmp_path: Path, where: str, request: pytest.FixtureRequest) -> None:
    out = folder(where, tmp_path, request)
    fit(tmp_path / "sync", async_save=False, save_last=True)
    fit(out / "async", async_save=True, save_last=True)
    atomic.wait_for_cleanup()  # replaced files are unlinked in the background
    names = sorted(os.listdir(tmp_path / "sync"))
    assert names == sorted(os.listdir(out / "async")) and len(names) == 7  # 6 steps and last.ckpt
    for name in names:
        a, b = tensors_of(load_checkpoint(tmp_path / "sync" / name)), tensors_of(load_checkpoint(out / "async" / name))
        assert a.keys() == b.keys() and len(a) > 10
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)


_PEAK_CHILD = f"""
import json, sys, threading
sys.path.insert(0, {TESTS_DIR!r})
from pathlib import Path
import test_async_save as t
dirpath, async_save = Path(sys.argv[1]), sys.argv[2] == "1"
queued = [0]
def watch():  # how many saves wait in the plugin's queue (not yet being written), sampled while training runs
    while not done.is_set():
        worker = getattr(t.IO._executor, "_queue", None)
        if worker is not None:
            jobs = list(worker._queue.queue)
            queued[0] = max(queued[0], sum(1 for job in jobs if isinstance(job, tuple) and getattr(job[0], "__name__", "") == "_write"))
        done.wait(0.002)
done = threading.Event()
watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
t.fit_recording(dirpath, async_save)
done.set()
watcher.join()  # no thread left running while the interpreter finalizes
print(json.dumps({{"vmhwm_kb": int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]),
                  "queued": queued[0]}}))
"""

IO: OrtCheckpointIO | None = None


def fit_recording(dirpath: Path, async_save: bool) -> None:
    """``fit`` with a 64 MB frozen backbone and the plugin kept in ``IO`` for the child's queue watcher; every tensor
    is staged (``share_frozen=False``: sharing would leave the unchanged backbone uncopied)."""
    global IO
    IO = OrtCheckpointIO(async_save=async_save, share_frozen=False)
    pl.seed_everything(0, verbose=False)
    callback = OrtCheckpoint(dirpath, every_n_train_steps=1, keep_newest=2)
    trainer = pl.Trainer(max_steps=16, callbacks=[callback], plugins=[IO], accelerator="cpu", devices=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Backboned(frozen_mb=64), loader())


def test_async_saves_are_bounded(tmp_path: Path) -> None:
    peaks = {}
    for mode in ("sync", "async"):
        child = tmp_path / "child.py"
        child.write_text(textwrap.dedent(_PEAK_CHILD))
        out = subprocess.run([sys.executable, str(child), str(tmp_path / mode), str(int(mode == "async"))],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        peaks[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    checkpoint_mb = max(os.path.getsize(tmp_path / "sync" / n) for n in os.listdir(tmp_path / "sync")) / 2**20
    assert checkpoint_mb > 64
    extra_mb = (peaks["async"]["vmhwm_kb"] - peaks["sync"]["vmhwm_kb"]) / 1024
    # one staged checkpoint at most (before: a staged copy per pending save, 11 pending after 24 steps here)
    assert extra_mb < 1.25 * checkpoint_mb, (extra_mb, checkpoint_mb, peaks)
    assert peaks["async"]["queued"] <= 1, peaks  # the save being staged may wait behind the one being written
    assert sorted(os.listdir(tmp_path / "sync")) == sorted(os.listdir(tmp_path / "async"))


class ChangesWeightsInPlace(Backboned):
    """Scales the head in place at the start of each step, outside ``optimizer.step``: a pattern asynchronous saving
    cannot copy consistently (weight normalisation done by hand, say)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == 1:
            with torch.no_grad():
                self.head[0].weight.mul_(0.5)


class StallWriter(pl.Callback):
    """Holds the background writer for a moment before the first save, so its deferred copy is still pending when
    the next step starts."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            trainer.strategy.checkpoint_io._executor.run(time.sleep, 1.0)


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_in_place_change_during_pending_copy_fails_loudly(tmp_path: Path, where: str,
                                                         request: pytest.FixtureRequest) -> None:
    """Also where the save writes from the live tensors (memory): the write is not committed, and the optimizer
    step that waited for it goes on (the error is raised at the next save, not a hang)."""
    tmp_path = folder(where, tmp_path, request)
    callback = OrtCheckpoint(tmp_path, every_n_train_steps=1, save_top_k=-1, async_save=True)
    trainer = pl.Trainer(max_steps=3, callbacks=[StallWriter(), callback], accelerator="cpu", devices=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(CheckpointSaveError, match=r"'head.0.weight'.*changed in place while its asynchronous save"):
        trainer.fit(ChangesWeightsInPlace(), loader())
    assert not any(n.endswith("step=1.ckpt") for n in os.listdir(tmp_path))  # the torn file was never written


def test_a_step_waits_for_the_copy_after_its_closure_and_before_its_update() -> None:
    """Lightning steps with a closure that runs forward and backward: those overlap the copy, the update does not."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model.weight.detach().clone()
    staged, copy_later = staging.Stager().stage(CheckpointContents(trainable={"w": model.weight.detach()}), "x.ckpt",
                                                staging.optimizer_tensors([optimizer]), [], lambda: None,
                                                optimizers=[optimizer])
    seen_pending = []

    def closure() -> torch.Tensor:
        seen_pending.append(not copy_later.done.is_set())
        optimizer.zero_grad()
        loss = model(torch.ones(2, 64)).square().sum()
        loss.backward()
        return loss

    writer = threading.Timer(0.3, copy_later)  # the writer thread makes the copy a moment later
    writer.start()
    optimizer.step(closure)
    writer.join()
    assert seen_pending == [True]  # the forward and backward pass ran while the copy was pending
    assert torch.equal(staged.trainable["w"], before)  # and the update waited for it: the copy is the old step's
    assert not torch.equal(model.weight.detach(), before)
