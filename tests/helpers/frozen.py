"""The frozen backbone of the frozen-sharing tests: its fits, saves and the files they leave, and the fixture that
makes saves alternate copies from the first (tests/lightning_side/test_frozen_sharing.py, test_sharing_redundancy.py,
test_healing.py)."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt._sharing import _copies as frozen_copies
from lightning_ort_ckpt._sharing import _limits as limits
from lightning_ort_ckpt.format import CheckpointContents, OptimizerGroup
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt.format import _shared_data as shared
from lightning_ort_ckpt.format._shared_data import SharedFrozen

from helpers.zoo_models import BATCH, ZOO


ENTRY = next(e for e in ZOO if e.name == "frozen_backbone")


SHARED = "backbone.2.weight"  # the one frozen tensor large enough to share


@pytest.fixture(autouse=True)
def second_copy_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No window with one copy: the save after a fresh copy waits for the second copy (written in the background),
    so that saves alternate between the two copies from the first on, as these tests count them
    (tests/lightning_side/test_sharing_redundancy.py tests the window, with the default)."""
    monkeypatch.setattr(limits, "ONE_COPY_SAVES", 0)


class Scored(type(ENTRY.build(0))):  # type: ignore[misc]
    """The zoo's frozen backbone, logging a score that ranks later steps better (for top-k)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("score", float(self.global_step))
        return loss


class StateAtSave(pl.Callback):
    """The module's state_dict at every save, by file name (cloned)."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        self.states[trainer.global_step] = {k: v.detach().clone() for k, v in module.state_dict().items()}


def loader() -> DataLoader:
    x, y = ENTRY.data()
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def fit(directory: Path, steps: int = 6, ckpt_path: Any = None, model: Any = None, io: Any = None,
        extra: tuple[pl.Callback, ...] = (), **callback: Any) -> tuple[pl.Trainer, OrtCheckpoint, StateAtSave]:
    """Fit the frozen backbone with a save at every step (``callback``: more OrtCheckpoint arguments)."""
    kwargs = {"every_n_train_steps": 1, "save_top_k": -1, **callback}
    cb, states = OrtCheckpoint(dirpath=directory, **kwargs), StateAtSave()
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb, states, *extra], max_steps=steps,
                         deterministic=True, plugins=[io] if io is not None else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model if model is not None else ENTRY.build(0), loader(),
                    ckpt_path=None if ckpt_path is None else str(ckpt_path))
    atomic.wait_for_cleanup()
    return trainer, cb, states


def checkpoints(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(".ckpt") and not p.name.startswith("."))


def inode(path: Path) -> int:
    return os.stat(atomic.data_path(str(path))).st_ino


def frozen_checkpoint(seed: int, frozen_seed: int = 0) -> CheckpointContents:
    """A fine-tuning state: a 1.5 MiB frozen backbone (from ``frozen_seed``), a head and its AdamW state."""
    g = torch.Generator().manual_seed(frozen_seed)
    backbone = {"backbone.0.weight": torch.randn(512, 512, generator=g),
                "backbone.1.weight": torch.randn(256, 512, generator=g)}
    h = torch.Generator().manual_seed(seed)
    head = torch.randn(3, 512, generator=h)
    moments = {"momentum0": torch.randn(3, 512, generator=h), "momentum1": torch.rand(3, 512, generator=h)}
    return CheckpointContents(trainable={"head.weight": head},
                      frozen={**backbone, "bn.running_mean": torch.randn(8, generator=h)},
                      optimizer_groups={"group0": OptimizerGroup(seed, 0.5, {"head.weight": moments})},
                      properties={"tag": f"checkpoint-{seed}"})


def linked_spec(first: shared.SavedData, source: str) -> SharedFrozen:
    return SharedFrozen(dict(first.offsets), source, first.identity, dict(first.digests))


def frozen_module(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(1024, 512).requires_grad_(False)


def flip(path: Path, keep_mtime: bool) -> None:
    """Flip one byte in the middle of ``path`` as a disk or a stray write would (mode 0444 stops no root)."""
    st = path.stat()
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    os.chmod(path, 0o444)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_mtime_ns == st.st_mtime_ns) == keep_mtime


def record_read_backs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(thread, file name) of every read-back of a copy (``verify_data`` called by ``_sharing._copies``, the copies
    ``_sharing`` tracks) from now on."""
    calls: list[tuple[str, str]] = []
    verify = frozen_copies.verify_data

    def recorded(path: str, *args: Any) -> Any:
        calls.append((threading.current_thread().name, os.path.basename(path)))
        return verify(path, *args)

    monkeypatch.setattr(frozen_copies, "verify_data", recorded)
    return calls


class StartStep(pl.Callback):
    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.step = trainer.global_step
