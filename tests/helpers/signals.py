"""The signals tests' shared parts: a stand-in ``scontrol``, the callback that holds a child at a batch boundary
until its signal is handled, and reading the output of 2 rank processes."""

from __future__ import annotations

import os
import select
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl


class Waits(pl.Callback):
    """In the child: says where training is, and at given steps waits for the signal the parent answers with
    (``sigterm``: until Lightning saw it; ``requeued``: until the stand-in ``scontrol`` ran in the handler;
    ``val-sigterm``: as ``sigterm``, after the second validation batch of that step, or of the sanity check at step
    0), so the signal is handled at that batch boundary however loaded the machine."""

    def __init__(self, waits: dict[int, str]) -> None:
        self.waits = waits

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        print(f"training {trainer.global_step}", flush=True)
        what = self.waits.get(trainer.global_step)
        while what == "sigterm" and not trainer.received_sigterm or \
                what == "requeued" and not os.path.exists(os.environ["REQUEUE_LOG"]):
            time.sleep(0.01)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx == 1 and self.waits.get(trainer.global_step) == "val-sigterm":
            while not trainer.received_sigterm:
                time.sleep(0.01)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        print(f"interrupted {trainer.global_step} {type(exception).__name__}", flush=True)


def interrupted_at(out: str) -> int:
    found = [line.split() for line in out.splitlines() if line.startswith("interrupted ")]
    assert found and found[0][2] == "SIGTERMException", out
    return int(found[0][1])


def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in ``scontrol`` first on ``PATH``, recording its arguments; SLURM's variables of a 1-task job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "requeue.log"
    tool = bin_dir / "scontrol"
    tool.write_text(f'#!/bin/sh\necho "$@" > "{log}.tmp" && mv "{log}.tmp" "{log}"\n')
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    for name, value in {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "REQUEUE_LOG": str(log),
                        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
                        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    return log


def until_both(procs: list[Any], line: str, out: list[list[str]]) -> None:
    """Read both ranks' output until each printed ``line`` (bounded: only a hang fails)."""
    seen, deadline = [False, False], time.monotonic() + 300
    while not all(seen):
        assert time.monotonic() < deadline, "".join(out[0] + out[1])
        ready, _, _ = select.select([p.stdout for p in procs], [], [], 1.0)
        for r, p in enumerate(procs):
            if p.stdout in ready:
                text = p.stdout.readline()
                assert text, f"rank {r} ended early:\n" + "".join(out[r])
                out[r].append(text)
                seen[r] = seen[r] or text.startswith(line)


def finish(procs: list[Any], out: list[list[str]]) -> None:
    """The rest of each rank's output (bounded); a rank still running after that is killed."""
    try:
        for r, p in enumerate(procs):
            out[r].append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
