"""Every signal a scheduler sends, at random points of a fit (issue 39): is the current step committed, how long
from the signal to the exit, and does anything hang.

    python benchmarks/signals.py                  # 50 trials of each signal (the issue's count)
    python benchmarks/signals.py --trials 10      # quick look

The parent imports torch and Lightning once and forks each training process (no torch op runs in the parent). A
child fits a small MLP (dropout, AdamW, a shuffled loader) for 12 steps, validating every 3 steps (4 batches), with
``OrtCheckpoint(persistent, every 100 steps, local=LocalTier(fast, every 5 steps, keep 2))``, so that the step a fit
stops at is mostly one only the signal's save commits; ``async_save`` alternates, but is on for the "async save"
point. Each trial picks a point at random and sends the signal at a random moment within it:

* **training**: 0-20 ms after a random step (2-7) starts (in the step, its hooks, a save);
* **validation**: 0-20 ms after the validation of step 3, 6 or 9 starts; the child holds after the third of its 4
  batches until the signal was sent, so it lands in validation;
* **sanity check**: a first fit trains 2-8 steps (the fast tier every step) and ends; a relaunch without
  ``ckpt_path`` (Lightning runs no sanity check when it resumes) runs 4 sanity-check batches and gets the signal
  0-20 ms into them (held as in validation): nothing new to save, so "last" must still resume the first fit's step;
* **async save**: 0-20 ms after the background write of step 5's fast-tier file starts; the write holds until the
  signal was sent, so it lands while that save is in progress.

**SIGTERM** (spot machines, Kubernetes): Lightning stops at the next batch boundary and the fast tier saves the
current step. **SIGUSR1** under ``SLURMEnvironment(auto_requeue=True)``: Lightning's handler saves
``hpc_ckpt_1.ckpt`` through our plugin and runs ``scontrol requeue``; the stand-in ``scontrol`` on ``PATH`` (the
only fake) sends the job SIGTERM, as SLURM's requeue does, so the fit then stops as above.

Counted per trial: **committed** when a fresh process's ``fit(ckpt_path="last")`` resumes at the step the fit
stopped at (reported by ``on_exception``; in the sanity check: the first fit's step; for SIGUSR1 also: the hpc
file loads); the **time** from the signal to
the process's exit; a **hang** when the process is still alive 60 s after the signal (it is then killed: a deadlock
in a handler would be one).
"""

from __future__ import annotations

import argparse
import os
import random
import select
import shutil
import signal
import statistics
import stat
import sys
import tempfile
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import LocalTier, OrtCheckpoint, load_checkpoint
from tiers import _in_child, step_in_child

POINTS = ("training", "validation", "sanity check", "async save")
HANG_S = 60.0


class Net(pl.LightningModule):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Dropout(0.1), nn.Linear(4 * width, width))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(48, 32, generator=g), torch.randn(48, 32, generator=g)),
                      batch_size=4, shuffle=True)


class Reports(pl.Callback):
    """Says on a pipe where the fit is (``t<step>`` at a training batch's start, ``v<step>`` at a validation's first
    batch, ``x<step>`` at an exception, ``end`` when it finished) and holds after the third batch of the validation of step ``hold`` (or of
    the sanity check) until the parent has sent its signal (the file ``sent`` exists)."""

    def __init__(self, fd: int, hold: int | None, sent: str) -> None:
        self.fd, self.hold, self.sent = fd, hold, sent

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        os.write(self.fd, f"t{trainer.global_step}\n".encode())

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if batch_idx == 0:
            os.write(self.fd, f"v{trainer.global_step}\n".encode())

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx == 2 and trainer.global_step == self.hold:
            _until(self.sent)

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        os.write(self.fd, f"x{trainer.global_step}\n".encode())

    def on_fit_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        os.write(self.fd, b"end\n")


def _until(path: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)


def _slow_write(root: str, fd: int, sent: str) -> None:
    """The fast tier's store, whose write of ``step=5.ckpt`` (on the background thread) says ``w`` and holds until
    the parent has sent its signal."""
    from lightning_ort_ckpt.format._local_store import LocalStore
    from lightning_ort_ckpt.format._store import register

    fast = os.path.join(root, "fast")

    class SlowWrite(LocalStore):
        @classmethod
        def handles(cls, path: Any) -> bool:
            return path is not None and os.fspath(path).startswith(fast)

        def writing(self, path: str, **kwargs: Any) -> Any:
            if os.path.basename(path) == "step=5.ckpt":
                os.write(fd, b"w\n")
                _until(sent)
            return super().writing(path, **kwargs)

    register(SlowWrite)


def _trainer(root: str, callbacks: list[pl.Callback], async_save: bool, every: int, steps: int = 12,
             sanity: int = 0, slurm: bool = False) -> pl.Trainer:
    from pytorch_lightning.plugins.environments import SLURMEnvironment

    callback = OrtCheckpoint(os.path.join(root, "persistent"), every_n_train_steps=100, async_save=async_save,
                             local=LocalTier(os.path.join(root, "fast"), every, 2))
    return pl.Trainer(max_steps=steps, callbacks=[*callbacks, callback], accelerator="cpu", devices=1, logger=False,
                      plugins=[SLURMEnvironment(auto_requeue=True)] if slurm else [], default_root_dir=root,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=sanity,
                      val_check_interval=3, limit_val_batches=4)


def _fit_in_child(root: str, write: int, read: int, **kwargs: Any) -> int:
    hold, slow = kwargs.pop("hold"), kwargs.pop("slow")
    sent = os.path.join(root, "sent")

    def train() -> None:
        os.close(read)
        if kwargs["slurm"]:
            os.environ.update(_slurm_env(root))
        if slow:
            _slow_write(root, write, sent)
        pl.seed_everything(0, verbose=False)
        try:
            _trainer(root, [Reports(write, hold, sent)], **kwargs).fit(Net(), _data(), _data())
        except SystemExit:  # Lightning's SIGTERMException: the exit the signal asks for
            pass

    return _in_child(train)


def _slurm_env(root: str) -> dict[str, str]:
    """A 1-task SLURM job, and the stand-in ``scontrol``: it records the requeue and sends the job SIGTERM."""
    bin_dir = os.path.join(root, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    tool = os.path.join(bin_dir, "scontrol")
    with open(tool, "w") as f:
        f.write(f'#!/bin/sh\necho "$@" > "{root}/requeued"\nkill -TERM $PPID\n')
    os.chmod(tool, os.stat(tool).st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train",
            "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
            "SLURM_NODELIST": "127.0.0.1"}


def _resumed_step(root: str) -> int | None:
    """The step ``fit(ckpt_path="last")`` resumes from, in a forked process (None if it failed)."""
    def resume() -> pl.Trainer:
        trainer = _trainer(root, [], False, 5, steps=0)  # loads, trains nothing
        trainer.fit(Net(), _data(), _data(), ckpt_path="last")
        return trainer

    return step_in_child(resume)


def one_trial(root: str, sig: int, point: str, async_save: bool, rng: random.Random) -> dict[str, Any]:
    slurm = sig == signal.SIGUSR1
    hold, sanity, expected = None, 0, None  # expected: the step "last" must resume (None: where the fit stopped)
    if point == "validation":
        hold = rng.choice((3, 6, 9))
        wait_for, delay = f"v{hold}", rng.uniform(0, 0.02)
    elif point == "sanity check":
        first = rng.randint(2, 8)
        read, write = os.pipe()
        pid = _fit_in_child(root, write, read, hold=None, slow=False, async_save=async_save,
                            every=1, steps=first, slurm=False)
        os.close(write)
        with os.fdopen(read, "rb") as out:
            out.read()  # (its reports: read to the end, as it exits)
        os.waitpid(pid, 0)
        hold, sanity, expected = 0, 4, first  # a relaunch without ckpt_path (Lightning checks none at a resume)
        wait_for, delay = "v0", rng.uniform(0, 0.02)
    elif point == "async save":
        async_save, wait_for, delay = True, "w", rng.uniform(0, 0.02)
    else:
        wait_for, delay = f"t{rng.randint(2, 7)}", rng.uniform(0, 0.02)
    read, write = os.pipe()
    pid = _fit_in_child(root, write, read, hold=hold, slow=point == "async save",
                        async_save=async_save, every=5, sanity=sanity, slurm=slurm)
    os.close(write)
    lines, buffer, deadline = [], b"", time.monotonic() + HANG_S
    while wait_for not in lines and time.monotonic() < deadline:
        if select.select([read], [], [], 1.0)[0]:
            chunk = os.read(read, 4096)
            if not chunk:
                break
            *new, buffer = (buffer + chunk).split(b"\n")
            lines += [line.decode() for line in new]
    time.sleep(delay)
    sent = time.perf_counter()
    os.kill(pid, sig)
    open(os.path.join(root, "sent"), "w").close()
    hung = True
    while time.perf_counter() - sent < HANG_S:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            hung = False
            break
        time.sleep(0.002)
    took = time.perf_counter() - sent
    if hung:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    while select.select([read], [], [], 0)[0] and (chunk := os.read(read, 4096)):
        buffer += chunk
    os.close(read)
    lines += [line.decode() for line in buffer.split(b"\n") if line]
    stopped = next((int(line[1:]) for line in lines if line.startswith("x")), None)
    resumed = _resumed_step(root)
    hpc_ok = True
    if slurm:
        try:
            load_checkpoint(os.path.join(root, "hpc_ckpt_1.ckpt"))
        except Exception:  # noqa: BLE001 - a missing or broken hpc file fails the trial
            hpc_ok = False
    late = stopped is None and "end" in lines  # the fit finished before the signal landed (steps take ms)
    want = stopped if expected is None else expected
    return {"point": point, "hung": hung, "late": late, "took": took,
            "committed": not hung and stopped is not None and resumed == want and hpc_ok}


def run(trials: int, seed: int) -> None:
    rng = random.Random(seed)
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        rows = []
        for trial in range(trials):
            root = tempfile.mkdtemp(prefix="signals-")
            try:
                rows.append(one_trial(root, sig, rng.choice(POINTS), bool(trial % 2), rng))
            finally:
                shutil.rmtree(root, ignore_errors=True)
        name = "SIGTERM" if sig == signal.SIGTERM else "SIGUSR1 (SLURM requeue)"
        print(f"\n## {name}: {trials} trials at random points\n")
        print("| point | trials | current step committed | signal to exit: median | max | hangs | finished first |")
        print("|---|---|---|---|---|---|---|")
        for point in (*POINTS, None):
            done = [r for r in rows if point is None or r["point"] == point]
            counted = [r for r in done if not r["late"]]
            times = [r["took"] for r in counted if not r["hung"]] or [float("nan")]
            print(f"| {point or '**all**'} | {len(done)} | {sum(r['committed'] for r in counted)}/{len(counted)} | "
                  f"{statistics.median(times):.2f} s | {max(times):.2f} s | {sum(r['hung'] for r in done)} | "
                  f"{sum(r['late'] for r in done)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=50, help="trials of each signal")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"python {' '.join(sys.argv)}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    run(args.trials, args.seed)


if __name__ == "__main__":
    main()
