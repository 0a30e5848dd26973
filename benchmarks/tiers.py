"""The fast tier (``OrtCheckpoint(local=LocalTier(...))``, issue 39): the work a SIGKILL costs, and what saving
every step costs training.

    python benchmarks/tiers.py                          # 20 kills, a 25M-parameter model for the overhead
    python benchmarks/tiers.py --kills 100 --params-m 25 --steps 30 --rounds 3
    python benchmarks/tiers.py --kills 6 --params-m 2 --steps 10          # quick look

**Lost work.** The parent imports torch and Lightning once and forks each training process (no torch op runs in the
parent, so forking is safe). A child fits a small MLP with AdamW for 60 steps, ``OrtCheckpoint(dirpath, every 20
steps, local=LocalTier(fast folder, every step, keep 2))``, both folders in ``/dev/shm`` where it exists (where an
asynchronous save writes from the live tensors), alternately with ``async_save`` off and on, and says on
a pipe each step it finished (at the next batch's start: every save of that step has been asked for). The parent
SIGKILLs it at a random step, after a random 0-30 ms more (so the kill lands anywhere: in a step, in a save, in the
background write). Another forked child then runs ``fit(ckpt_path="last")`` with the same callback and says which
step it resumed from. Lost steps per kill = the last step the killed child reported finished - the step resumed
from (the child may have finished one step more than it reported, so the true loss can be one more). Goal: <= 1
step at K=1, and never a start from scratch.

**SIGTERM.** The same fit gets SIGTERM at a random step and point (``--sigterms`` trials, alternately sync and
async), the fast tier every 5 steps (so that the step it stops at is mostly one only the SIGTERM saves); Lightning
stops it at the next batch boundary, where the fast tier saves the current step. Counted: the
fits whose "last" resumes at the very step they stopped at, and the time from the signal to the process's exit.

**Overhead.** A ``--params-m`` million-parameter MLP (blocks of ``Linear(d, 4d)``, ``Linear(4d, d)``) with AdamW
trains ``--steps`` steps (``--threads`` torch threads, 1 by default) three ways in one process, in turn: no checkpointing, the fast tier every step with
``async_save=True``, every 10 steps (the folder in ``/dev/shm`` where it exists, as the tier is meant to be used).
The time from the first step after 2 warm-up steps to the end of ``fit`` (which waits for every queued save) is
compared with the run without saves; targets 1.05x (every step) and 1.02x (every 10). A first round, dropped, warms
the process up; then ``--rounds`` rounds run the three in turn, and each one's median is reported, with the CPU time
the process used meanwhile (all its threads: the save's work whether or not a free core hid it; on a machine other
jobs share, a steadier figure than the wall time). ``--kills 0 --sigterms 0`` runs the overhead part alone.
"""

from __future__ import annotations

import argparse
import os
import random
import select
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import LocalTier, OrtCheckpoint

KILL_STEPS = 60


class Small(pl.LightningModule):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Reports(pl.Callback):
    """Writes ``<step>\\n`` to a pipe at each batch's start (the steps before it are finished and their saves
    asked), and ``x<step>\\n`` at an exception (a SIGTERM's: the step the fit stops at)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        os.write(self.fd, f"{trainer.global_step}\n".encode())

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        os.write(self.fd, f"x{trainer.global_step}\n".encode())


def _data(width: int, n: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)),
                      batch_size=8, shuffle=True)


def _trainer(callbacks: list[pl.Callback], steps: int, devices: int = 1, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, callbacks=callbacks, accelerator="cpu", devices=devices, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _callback(root: str, async_save: bool, every: int = 1) -> OrtCheckpoint:
    return OrtCheckpoint(os.path.join(root, "persistent"), every_n_train_steps=20, save_top_k=-1,
                         async_save=async_save, local=LocalTier(os.path.join(root, "fast"), every, 2))


def _in_child(run: Any) -> int:
    """Fork; the child runs ``run()`` with warnings and logs quiet and exits without returning."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            import logging

            logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
            warnings.simplefilter("ignore")
            torch.set_num_threads(1)
            run()
        except BaseException:  # noqa: BLE001 - the child's failure is its exit status
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    return pid


class Steps:
    """What forked fits report on their pipes (``Reports``): the newest step each said it finished, -1 before its
    first. Reads are bounded by a deadline (a hung fit ends a wait, never blocks it); a pipe closes when its fit has
    ended."""

    def __init__(self, fds: list[int]) -> None:
        self.newest = [-1] * len(fds)
        self._fds, self._open, self._buffers = fds, set(fds), {fd: b"" for fd in fds}

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select(list(self._open), [], [], timeout)
        for fd in ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                self._open.discard(fd)
            *lines, self._buffers[fd] = (self._buffers[fd] + chunk).split(b"\n")
            i = self._fds.index(fd)
            self.newest[i] = max([self.newest[i], *(int(line) for line in lines if line and line[:1] != b"x")])

    def until(self, step: int, deadline: float) -> bool:
        """Reads until a fit reported ``step`` (True), or every fit ended or the deadline passed (False)."""
        while max(self.newest) < step and self._open and time.monotonic() < deadline:
            self._read(min(1.0, max(0.0, deadline - time.monotonic())))
        return max(self.newest) >= step

    def quiet(self, seconds: float, deadline: float) -> bool:
        """Reads until every fit ended (True), or none reported a step for ``seconds`` or the deadline passed
        (False: a fit is stuck)."""
        last = time.monotonic()
        while self._open and time.monotonic() - last < seconds and time.monotonic() < deadline:
            before = list(self.newest)
            self._read(min(1.0, seconds))
            if self.newest != before:
                last = time.monotonic()
        return not self._open

    def close(self, deadline: float) -> bool:
        """Reads what the fits reported before they ended, then closes the pipes; False if one was still open at
        the deadline."""
        while self._open and time.monotonic() < deadline:
            self._read(min(1.0, max(0.0, deadline - time.monotonic())))
        ended = not self._open
        for fd in self._fds:
            os.close(fd)
        return ended


def one_kill(root: str, async_save: bool, rng: random.Random) -> tuple[int, int]:
    """(the last step the killed fit reported finished, the step ``fit(ckpt_path="last")`` resumed from)."""
    read, write = os.pipe()
    kill_at = rng.randint(3, KILL_STEPS - 5)

    def train() -> None:
        os.close(read)
        pl.seed_everything(0, verbose=False)
        _trainer([Reports(write), _callback(root, async_save)], KILL_STEPS).fit(Small(), _data(64, 4096))

    pid = _in_child(train)
    os.close(write)
    steps = Steps([read])
    steps.until(kill_at, time.monotonic() + 300)  # only a hang ends a trial this way
    time.sleep(rng.uniform(0, 0.03))
    os.kill(pid, signal.SIGKILL)
    steps.close(time.monotonic() + 300)  # what it reported before the kill landed
    os.waitpid(pid, 0)
    return steps.newest[0], _resumed_step(root)


def step_in_child(fit: Any) -> int | None:
    """The global step of the Trainer ``fit()`` returns once it has run, in a forked process; None if it failed."""
    read, write = os.pipe()

    def run() -> None:
        os.close(read)
        os.write(write, f"{fit().global_step}\n".encode())

    pid = _in_child(run)
    os.close(write)
    with os.fdopen(read, "rb") as out:
        text = out.read().decode().strip()
    _, status = os.waitpid(pid, 0)
    return int(text) if status == 0 and text else None


def _resumed_step(root: str) -> int:
    """The step ``fit(ckpt_path="last")`` resumes from, in a forked process."""
    def resume() -> pl.Trainer:
        trainer = _trainer([_callback(root, False)], 0)  # loads, trains nothing
        trainer.fit(Small(), _data(64, 4096), ckpt_path="last")
        return trainer

    step = step_in_child(resume)
    if step is None:
        raise RuntimeError(f"the resume in {root} failed")
    return step


def one_sigterm(root: str, async_save: bool, rng: random.Random) -> tuple[int, int, float] | None:
    """SIGTERM at a random point: (the step the fit stopped at, the newest step committed in the fast tier and
    resumed from, seconds from the signal to the process's exit); None where the fit ended before the signal landed
    (its steps take milliseconds: the pipe may be read behind them)."""
    read, write = os.pipe()
    signal_at = rng.randint(3, KILL_STEPS - 5)

    def train() -> None:
        os.close(read)
        pl.seed_everything(0, verbose=False)
        _trainer([Reports(write), _callback(root, async_save, every=5)], KILL_STEPS).fit(Small(), _data(64, 4096))

    pid = _in_child(train)
    os.close(write)
    buffer = b""
    while not any(line.isdigit() and int(line) >= signal_at for line in buffer.split(b"\n")):
        chunk = os.read(read, 4096)
        if not chunk:
            break
        buffer += chunk
    time.sleep(rng.uniform(0, 0.03))
    sent = time.perf_counter()
    os.kill(pid, signal.SIGTERM)
    os.waitpid(pid, 0)
    took = time.perf_counter() - sent
    while chunk := os.read(read, 4096):
        buffer += chunk
    os.close(read)
    stopped = [int(line[1:]) for line in buffer.split(b"\n") if line[:1] == b"x"]
    if not stopped:
        return None
    return stopped[0], _resumed_step(root), took


def sigterms(trials: int, seed: int) -> None:
    rng = random.Random(seed + 1)
    rows: dict[bool, list[tuple[int, int, float]]] = {False: [], True: []}
    late = 0
    for trial in range(trials):
        root = tempfile.mkdtemp(prefix="tiers-term-")
        try:
            got = one_sigterm(root, bool(trial % 2), rng)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        if got is None:
            late += 1
        else:
            rows[bool(trial % 2)].append(got)
    print(f"\n## SIGTERM at random points ({trials} trials, in training; fast tier every 5 steps)\n")
    print("| saves | trials | current step committed and resumed from | signal to exit: median | max |")
    print("|---|---|---|---|---|")
    for async_save, done in rows.items():
        exact = sum(1 for stopped, resumed, _ in done if stopped == resumed)
        times = [t for _, _, t in done] or [float("nan")]
        print(f"| {'async' if async_save else 'sync'} | {len(done)} | {exact}/{len(done)} | "
              f"{statistics.median(times):.2f} s | {max(times):.2f} s |")
    print(f"\n{late} trial(s) ended their fit before the signal landed (not counted).")


_MEMORY = "/dev/shm" if os.path.isdir("/dev/shm") else None  # a fast tier's usual place: the folders go there


def lost_work(kills: int, seed: int) -> None:
    rng = random.Random(seed)
    results: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
    for trial in range(kills):
        async_save = bool(trial % 2)
        root = tempfile.mkdtemp(prefix="tiers-kill-", dir=_MEMORY)  # (async saves there: written from live tensors)
        try:
            results[async_save].append(one_kill(root, async_save, rng))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n## Lost work per SIGKILL ({kills} kills, fast tier every step, keep 2; persistent every 20 steps)\n")
    print("| saves | kills | steps lost: mean | max | from scratch | last step reported -> step resumed from |")
    print("|---|---|---|---|---|---|")
    for async_save, rows in results.items():
        lost = [max(0, done - resumed) for done, resumed in rows]
        scratch = sum(1 for done, resumed in rows if resumed == 0 and done >= 1)
        print(f"| {'async' if async_save else 'sync'} | {len(rows)} | {statistics.mean(lost):.2f} | {max(lost)} | "
              f"{scratch} | {[f'{d}->{r}' for d, r in rows]} |")


class Big(pl.LightningModule):
    """About ``params_m`` million float32 parameters: blocks of Linear(d, 4d), Linear(4d, d)."""

    def __init__(self, params_m: float, d: int = 512) -> None:
        super().__init__()
        blocks = max(1, round(params_m * 1e6 / (8 * d * d + 5 * d)))
        self.d = d
        self.net = nn.Sequential(*(nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d))
                                   for _ in range(blocks)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Clock(pl.Callback):
    """The time from the start of step ``warmup`` to the end of fit, and the process's CPU time (every thread's)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.cpu = warmup, 0.0, 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.start, self.cpu = time.perf_counter(), time.process_time()


def overhead(params_m: float, steps: int, rounds: int) -> None:
    base = _MEMORY
    times: dict[str, list[float]] = {"no saves": [], "every step": [], "every 10 steps": []}
    cpu: dict[str, list[float]] = {mode: [] for mode in times}
    n_params = 0
    for round_ in range(rounds + 1):  # round 0 warms the process up (allocator, kernels, Lightning) and is dropped
        for mode in times if round_ else ["every step"]:
            root = tempfile.mkdtemp(prefix="tiers-overhead-", dir=base)
            try:
                pl.seed_everything(0, verbose=False)
                model = Big(params_m)
                n_params = sum(p.numel() for p in model.parameters())
                clock = Clock(2)
                callbacks: list[pl.Callback] = [clock]
                if mode != "no saves":
                    callbacks.append(OrtCheckpoint(os.path.join(root, "persistent"), every_n_train_steps=10 ** 6,
                                                   async_save=True, local=LocalTier(os.path.join(root, "fast"),
                                                                                    1 if mode == "every step" else 10,
                                                                                    2)))
                trainer = _trainer(callbacks, steps, enable_checkpointing=mode != "no saves")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    trainer.fit(model, _data(model.d, 8 * steps))
                if round_:
                    times[mode].append(time.perf_counter() - clock.start)
                    cpu[mode].append(time.process_time() - clock.cpu)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    print(f"\n## Overhead of the fast tier ({n_params / 1e6:.1f}M parameters + AdamW, {steps - 2} timed steps, "
          f"async_save=True, folder in {base or tempfile.gettempdir()}; median of {rounds})\n")
    print("| run | time | per step | ratio to no saves | fastest round's ratio | CPU, all threads | CPU ratio |")
    print("|---|---|---|---|---|---|---|")
    reference, cpu_reference = statistics.median(times["no saves"]), statistics.median(cpu["no saves"])
    for mode, values in times.items():
        t, c = statistics.median(values), statistics.median(cpu[mode])
        print(f"| {mode} | {t:.2f} s | {1e3 * t / (steps - 2):.0f} ms | {t / reference:.3f}x | "
              f"{min(values) / min(times['no saves']):.3f}x | {c:.2f} s | {c / cpu_reference:.2f}x |")
    print("\nEach round's time, s: " + "; ".join(f"{mode}: {', '.join(f'{v:.2f}' for v in values)}"
                                               for mode, values in times.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--sigterms", type=int, default=10)
    parser.add_argument("--params-m", type=float, default=25.0)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2, help="of the overhead runs (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads for the overhead runs")
    args = parser.parse_args()
    print(f"python {' '.join(sys.argv)}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    if args.kills:
        lost_work(args.kills, args.seed)  # first: they fork, and the parent must not have run a torch op yet
    if args.sigterms:
        sigterms(args.sigterms, args.seed)
    torch.set_num_threads(args.threads)  # one: training and the writer thread share 2 cores without oversubscribing
    if args.rounds:
        overhead(args.params_m, args.steps, args.rounds)


if __name__ == "__main__":
    main()
