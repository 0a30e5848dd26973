"""The signals tests' shared parts: a stand-in ``scontrol``, the callback that holds a child at a batch boundary
until its signal is handled, reading the output of 2 rank processes, and the record of a resumed 2-rank fit's whole
state, compared with an uninterrupted one's."""

from __future__ import annotations

import os
import select
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch


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


RECORD = r'''
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict


class Record(pl.Callback):  # where a fit started, and its whole state once it ended (rank 0: root/<name>.pt)
    def __init__(self, name):
        self.name = name

    def on_train_start(self, trainer, pl_module):
        self.start, self.ckpt_path = trainer.global_step, trainer.ckpt_path and str(trainer.ckpt_path)

    def on_fit_end(self, trainer, pl_module):
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = trainer.strategy.model
        state = {"model": get_model_state_dict(model, options=opts),
                 "optim": get_optimizer_state_dict(model, trainer.optimizers[0], options=opts)}
        if trainer.global_rank == 0:
            torch.save(state, os.path.join(root, self.name + ".pt"))
        with open(os.path.join(root, f"{self.name}.rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"start": self.start, "ckpt_path": self.ckpt_path, "end": trainer.global_step}, f)
'''
"""The ``Record`` callback of the 2-rank scripts, as script text (it needs ``json``, ``os``, ``torch``, ``pl`` and
the script's output folder ``root``)."""


def assert_same_state(resumed: Path, reference: Path) -> None:
    """The module and optimizer states ``Record`` saved in ``resumed`` and ``reference`` are equal, bit for bit."""
    got, want = torch.load(resumed), torch.load(reference)
    assert want["model"].keys() == got["model"].keys()
    for k, t in want["model"].items():
        assert torch.equal(got["model"][k], t), k
    assert want["optim"]["state"]
    for param, moments in want["optim"]["state"].items():
        for name, t in moments.items():
            assert torch.equal(got["optim"]["state"][param][name], t), (param, name)
