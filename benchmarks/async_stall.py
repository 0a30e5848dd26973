"""Training-loop stall per checkpoint save with ``OrtCheckpointIO(async_save=True)``, against a synchronous save of the
same state; and the throughput of whole fits that save every N steps, without saves, with sync and with async saves.

    python benchmarks/async_stall.py                     # 25M float32 parameters, AdamW state, 10 saves per mode
    python benchmarks/async_stall.py --params-m 250 --saves 10
    python benchmarks/async_stall.py --params-m 5 --saves 3 --fit-steps 12 --every 3     # quick look

A ``LightningModule`` of ``--params-m`` million float32 parameters (an embedding-free MLP stack: blocks of
``Linear(d, 4d)``, ``Linear(4d, d)`` and ``LayerNorm``) trains with AdamW under a real ``Trainer`` (CPU, one device)
whose checkpoint plugin is ``OrtCheckpointIO``. After a few warm-up steps a callback, at ``on_train_batch_end`` as
``ModelCheckpoint`` does, calls ``trainer.save_checkpoint`` alternately with ``async_save`` off and on (the same
plugin object, made with ``async_save=True`` as a user makes it, so its staging memory is allocated ahead of the
first save: only the attribute changes, so both modes save the same state at neighbouring steps) and measures
the **stall**, the wall time training loses to the save:

* sync: the time inside ``trainer.save_checkpoint``: the whole save, fsync and atomic rename included;
* async: the time inside ``trainer.save_checkpoint`` (until training may change its tensors again) **plus** the time
  the next optimizer step waits for the copies made during its forward and backward pass (timed here by wrapping
  the staging module's wait, ``WAITED``).
  Training then runs on while the file is written; the steps that run while a write is in flight are timed against
  steps with nothing in flight.

Between saves (outside every timed region) the previous save is waited for, its file deleted, the deletion awaited
(``atomic.wait_for_cleanup``) and the page cache flushed (``os.sync``): replacing multi-GB files is slow on this
disk and must not land in a timed save. Targets (issues #13, #34): the median async stall at most 5% of the median
sync stall, and at most 10% in 9 saves out of 10, the first one included (printed on its own).

The breakdown times each part of an asynchronous save separately on the same state: Lightning's
``dump_checkpoint``, the plugin's owner lookup (``_owner_strategy``: the strategy bound in ``setup``),
``ModuleInfo.from_module``, RNG capture, ``to_ort``, the staging done before the save call returns
(``Stager.stage``: everything but the optimizer-held tensors) and the deferred copy (run on the writer thread
during the next forward/backward), next to a plain copy of the same tensors into fresh and into reused memory;
and what a first save costs beyond a later one: a fresh stager's staging with nothing allocated ahead, with memory
allocated but untouched (the page faults left to the copy), allocated and touched ahead (what ``Stager.prepare``
does after the first optimizer step), and starting the writer thread.

The fit comparison (``--fit-steps``, ``--every``) trains the same model for the same steps three times from the same
state: without saves, saving every ``--every`` steps synchronously, and asynchronously, and reports each fit's wall
time (target: the async fit is not slower than the sync one) and the overhead of saving over no saves.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import BindCheckpointIO
from lightning_ort_ckpt._fit_state import _rng as rng
from lightning_ort_ckpt._saving import _staging as staging
from lightning_ort_ckpt._saving._staging_memory import state_tensors

WAITED = {"seconds": 0.0}
"""Time optimizer steps spent waiting for deferred copies: the benchmark wraps the stagers' wait."""
_wait_for_copies = staging.Stager._wait_for_copies


def _timed_wait(*args: Any) -> None:
    t0 = time.perf_counter()
    _wait_for_copies(*args)
    WAITED["seconds"] += time.perf_counter() - t0


staging.Stager._wait_for_copies = _timed_wait  # type: ignore[method-assign]  # benchmark-only: the hook calls it
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt._saving._async_saver import BackgroundQueue
from lightning_ort_ckpt._plugin import OrtCheckpointIO
from lightning_ort_ckpt._fit_state._rng import RNG_KEY
from lightning_ort_ckpt._translation.lightning_dict import ModuleInfo, to_ort

WIDTH = 512
BATCH = 16
_FSYNC = {"seconds": 0.0}  # time spent in os.fsync by any thread (the wrapper below), to split a save in CPU and disk
_real_fsync = os.fsync


def _timed_fsync(fd: int) -> None:
    t0 = time.perf_counter()
    try:
        _real_fsync(fd)
    finally:
        _FSYNC["seconds"] += time.perf_counter() - t0


class Mlp(pl.LightningModule):
    """Blocks of Linear(d, 4d) -> GELU -> Linear(4d, d) + residual -> LayerNorm: ~8.4 d^2 parameters each."""

    def __init__(self, n_million: float) -> None:
        super().__init__()
        d = WIDTH
        per_block = 8 * d * d + 5 * d + 2 * d
        blocks = max(1, round(n_million * 1e6 / per_block))
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d), "norm": nn.LayerNorm(d)})
            for _ in range(blocks))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b["norm"](x + b["down"](nn.functional.gelu(b["up"](x))))
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def median_stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f} ms"


class SaveBench(pl.Callback):
    """Drives the saves from inside the training loop (at ``on_train_batch_end``, like ``ModelCheckpoint``)."""

    def __init__(self, plugin: OrtCheckpointIO, directory: str, saves: int, warmup: int) -> None:
        self.plugin, self.directory, self.warmup = plugin, directory, warmup
        self.stall: dict[str, list[float]] = {"sync": [], "async": []}
        self.stall_cpu: dict[str, list[float]] = {"sync": [], "async": []}  # the training thread's CPU time in the call
        self.waited: list[float] = []  # async: of the stall, the next optimizer step's wait for the deferred copies
        self.fsync: list[float] = []  # sync: of the stall, time in os.fsync
        self.step_times: dict[str, list[float]] = {"idle": [], "writing": []}
        self.plan = [m for _ in range(saves) for m in ("sync", "async")]
        self._step_start = 0.0
        self._skip_step = False  # the step whose end ran a save or a cleanup: not a plain training step
        self._started_writing = False
        self._in_flight: tuple[str, float, float] | None = None  # async save: path, call time, WAITED before it
        self.file_bytes = 0
        self.done = False

    def _writing(self) -> bool:
        """Whether the plugin's background worker has a task queued or running (private state, read only)."""
        worker = getattr(self.plugin, "_queue", None)
        return worker is not None and worker.busy()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._started_writing = self._writing()
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        elapsed = time.perf_counter() - self._step_start
        if trainer.global_step <= self.warmup or self._skip_step:
            self._skip_step = False
            return
        if self._in_flight is not None:  # the step after an async save: its optimizer step may have waited
            path, call, waited_before = self._in_flight
            if not self.stall["async"] or len(self.stall["async"]) < len(self.stall["sync"]):
                self.waited.append(WAITED["seconds"] - waited_before)
                self.stall["async"].append(call + self.waited[-1])
            if self._started_writing:
                self.step_times["writing"].append(elapsed)
            if self._writing():
                self._in_flight = (path, call, WAITED["seconds"])
                return
            self._finish(path)  # durable: clean up, untimed
            self._in_flight = None
            self._skip_step = True
            return
        if len(self.step_times["idle"]) < 5:  # steady-state steps with nothing in flight
            self.step_times["idle"].append(elapsed)
            return
        if not self.plan:
            self.done = True
            trainer.should_stop = True
            return
        mode = self.plan.pop(0)
        path = os.path.join(self.directory, f"{mode}-{trainer.global_step}.ckpt")
        self.plugin.async_save = mode == "async"
        gc.collect()  # not inside the timed region: a collection there would be noise, not the save's cost
        _FSYNC["seconds"] = 0.0
        waited_before = WAITED["seconds"]
        c0, t0 = time.thread_time(), time.perf_counter()
        trainer.save_checkpoint(path)
        t1, c1 = time.perf_counter(), time.thread_time()
        self.stall_cpu[mode].append(c1 - c0)
        if mode == "async":
            self._in_flight = (path, t1 - t0, waited_before)
            return
        self.stall[mode].append(t1 - t0)
        self.fsync.append(_FSYNC["seconds"])
        self._finish(path)
        self._skip_step = True

    def _finish(self, path: str) -> None:
        self.plugin.wait()
        self.file_bytes = max(self.file_bytes, os.path.getsize(path))
        atomic.remove(path)
        atomic.wait_for_cleanup()
        os.sync()


def breakdown(trainer: pl.Trainer, plugin: OrtCheckpointIO, reps: int) -> dict[str, dict[str, float]]:
    """Each part of an async save's stall, timed alone on the same state."""
    module, strategy = trainer.lightning_module, trainer.strategy
    parts: dict[str, list[float]] = {}

    def timed(name: str, fn: Any) -> Any:
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        parts.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    tensors = [t for t in module.state_dict().values()] + [
        v for s in trainer.optimizers[0].state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    reused = [torch.empty_like(t) for t in tensors]
    for r in reused:
        r.zero_()  # fault the pages in once
    first_saves(trainer, plugin, parts)
    stager = staging.Stager()
    for _ in range(reps):
        checkpoint = timed("lightning dump_checkpoint", lambda: trainer._checkpoint_connector.dump_checkpoint(False))
        timed("plugin _owner_strategy (as in a save)", lambda: plugin._owner_strategy(checkpoint["state_dict"]))
        info = timed("ModuleInfo.from_module", lambda: ModuleInfo.from_module(module, list(strategy.optimizers)))
        states = timed("rng.capture", rng.capture)
        ck = timed("to_ort", lambda: to_ort({**checkpoint, RNG_KEY: states}, info,
                                            ort_compatible=plugin.ort_compatible))
        optimizer_held = staging.optimizer_tensors(strategy.optimizers)
        _, job = timed("Stager.stage (before the save call returns)",
                       lambda: stager.stage(ck, "bench", optimizer_held, module.state_dict(keep_vars=True).values(),
                                            lambda: None))
        timed("  deferred copy (during the next forward/backward)", job)
        module.zero_grad()
        strategy.optimizers[0].step()  # a step between reps, so the next rep copies again (no reuse)
        fresh = timed("baseline: plain copy into fresh memory", lambda: [t.detach().clone() for t in tensors])
        del fresh
        timed("baseline: copy into reused memory", lambda: [r.copy_(t) for r, t in zip(reused, tensors)])
    parts_stats = {name: median_stats(v) for name, v in parts.items()}
    parts_stats["_meta"] = {"staged_bytes": sum(t.numel() * t.element_size() for t in tensors)}
    return parts_stats


def first_saves(trainer: pl.Trainer, plugin: OrtCheckpointIO, parts: dict[str, list[float]]) -> None:
    """What a first asynchronous save costs beyond a later one, part by part: a fresh stager's staging (before the
    save call returns, and the deferred copy) with nothing allocated ahead, with its memory allocated but not
    touched (the page faults left to the copy), and allocated and touched ahead (``Stager.prepare``); and the
    other first-time work: starting the writer thread."""
    module, strategy = trainer.lightning_module, trainer.strategy
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(False)
    info = ModuleInfo.from_module(module, list(strategy.optimizers))
    ck = to_ort({**checkpoint, RNG_KEY: rng.capture()}, info, ort_compatible=plugin.ort_compatible)
    live = list(module.state_dict(keep_vars=True).values())
    specs = [staging._spec(t) for t in [*live, *state_tensors(strategy.optimizers)]]
    for ahead in ("nothing", "untouched", "touched"):
        stager = staging.Stager()
        if ahead != "nothing":
            for spec, buffer in zip(specs, stager._memory.allocate(specs, ahead == "touched")):
                stager._memory.spares.setdefault(spec, []).append(buffer)
        gc.collect()
        t0 = time.perf_counter()
        _, job = stager.stage(ck, "bench", staging.optimizer_tensors(strategy.optimizers), live, lambda: None,
                              optimizers=strategy.optimizers)
        t1 = time.perf_counter()
        job()
        t2 = time.perf_counter()
        label = {"nothing": "nothing ahead", "untouched": "allocated ahead, untouched",
                 "touched": "allocated and touched ahead (prepare)"}[ahead]
        parts.setdefault(f"first save, {label}: stage", []).append(t1 - t0)
        parts.setdefault(f"first save, {label}: deferred copy", []).append(t2 - t1)
        stager.close()
    t0 = time.perf_counter()
    queue = BackgroundQueue()
    parts.setdefault("first save: start the writer thread", []).append(time.perf_counter() - t0)
    queue.close()


class EverySteps(pl.Callback):
    """Saves every ``every`` steps (sync or async, as the plugin is set)."""

    def __init__(self, directory: str, every: int) -> None:
        self.directory, self.every = directory, every

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            trainer.save_checkpoint(os.path.join(self.directory, f"fit-{trainer.global_step % (2 * self.every)}.ckpt"))


def fit_times(model: pl.LightningModule, data: TensorDataset, directory: str, steps: int, every: int,
              repeats: int) -> dict[str, list[float]]:
    """Wall time of ``steps`` training steps from the same state: without saves, with sync and with async saves
    every ``every`` steps (two files written in turn, so each save replaces an older file), in turn ``repeats``
    times."""
    start = {k: v.clone() for k, v in model.state_dict().items()}
    times: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    for _ in range(repeats):
        for mode in times:
            model.load_state_dict(start)
            plugin = OrtCheckpointIO(async_save=mode == "async")
            callbacks = [EverySteps(directory, every), BindCheckpointIO()] if mode != "none" else []
            trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, plugins=[plugin],
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 callbacks=callbacks)
            gc.collect()
            os.sync()
            t0 = time.perf_counter()
            trainer.fit(model, DataLoader(data, batch_size=BATCH))  # returns once every save is durable
            times[mode].append(time.perf_counter() - t0)
            for name in os.listdir(directory):
                atomic.remove(os.path.join(directory, name))
            atomic.wait_for_cleanup()
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-m", type=float, default=25.0, help="model size, millions of float32 parameters")
    ap.add_argument("--saves", type=int, default=10, help="timed saves per mode")
    ap.add_argument("--warmup", type=int, default=3, help="training steps before the first save")
    ap.add_argument("--breakdown-reps", type=int, default=5, help="repetitions of the per-part timing")
    ap.add_argument("--fit-steps", type=int, default=30, help="steps of each fit in the fit comparison (0: skip it)")
    ap.add_argument("--every", type=int, default=5, help="save every N steps in the fit comparison")
    ap.add_argument("--fit-repeats", type=int, default=3, help="fits per mode in the fit comparison (median)")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a new temporary directory "
                                                "under benchmarks/out/)")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    args = ap.parse_args(argv)

    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]), flush=True)
    try:
        here_repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        rev = subprocess.run(["git", "-C", here_repo, "describe", "--always", "--dirty"], capture_output=True,
                             text=True).stdout.strip()
    except OSError:
        rev = "?"
    print(f"lightning_ort_ckpt revision: {rev}")
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}, pytorch_lightning {pl.__version__}", flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    base = args.dir or os.path.join(here, "out")
    os.makedirs(base, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="async_stall-", dir=base)
    warnings.filterwarnings("ignore")

    torch.manual_seed(0)
    model = Mlp(args.params_m)
    n_params = sum(p.numel() for p in model.parameters())
    data = TensorDataset(torch.randn(BATCH * 4, WIDTH), torch.randn(BATCH * 4, 1))
    plugin = OrtCheckpointIO(async_save=True)  # as users make it: its staging memory is allocated ahead
    bench = SaveBench(plugin, directory, args.saves, args.warmup)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=100_000, max_epochs=-1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[plugin], callbacks=[bench, BindCheckpointIO()])
    print(f"model: {n_params / 1e6:.2f}M float32 parameters ({len(model.blocks)} blocks of width {WIDTH}), AdamW; "
          f"checkpoints in {directory}", flush=True)
    os.fsync = _timed_fsync  # the format layer calls os.fsync: time it (only this process, only this run)
    results: dict[str, Any] = {"command": sys.argv, "params": n_params}
    try:
        trainer.fit(model, DataLoader(data, batch_size=BATCH))
        assert bench.done, "training stopped before the saves were done"

        sync, asyn = median_stats(bench.stall["sync"]), median_stats(bench.stall["async"])
        ratio = asyn["median"] / sync["median"]
        ratios = [a / sync["median"] for a in bench.stall["async"]]  # in save order: the first save first
        within = sum(r <= 0.10 for r in ratios) / len(ratios)
        print(f"\ncheckpoint file: {bench.file_bytes / 1e6:.1f} MB ({bench.file_bytes / 1e6 / n_params * 1e6:.1f} "
              f"bytes per parameter); {args.saves} saves per mode, median [min .. max]")
        for label, st in (("sync stall (whole save, fsync incl.)", sync),
                          ("  of which in fsync", median_stats(bench.fsync)),
                          ("async stall (call + next step's wait)", asyn),
                          ("  of which the next step's wait", median_stats(bench.waited))):
            print(f"  {label:40s} {fmt(st['median'])}  [{fmt(st['min'])} .. {fmt(st['max'])}]")
        print(f"  async stall / sync stall, median: {ratio:.1%}  (target <= 5%: {'met' if ratio <= 0.05 else 'NOT MET'})")
        print(f"  saves whose async stall is <= 10% of the sync stall, the first included: {within:.0%} "
              f"(target >= 90%: {'met' if within >= 0.9 else 'NOT MET'}); each, in order: "
              + ", ".join(f"{r:.1%}" for r in ratios))
        print(f"  the first async save: {fmt(bench.stall['async'][0]).strip()}, {ratios[0]:.1%} of the median sync "
              f"stall (<= 10%: {'met' if ratios[0] <= 0.10 else 'NOT MET'})")
        cpu = {m: median_stats(v) for m, v in bench.stall_cpu.items()}
        print(f"  training thread CPU time inside the call: sync {fmt(cpu['sync']['median'])}, async "
              f"{fmt(cpu['async']['median'])}")
        print(f"  sync write throughput: {bench.file_bytes / sync['median'] / 1e6:.0f} MB/s")
        steps = {k: median_stats(v) for k, v in bench.step_times.items() if v}
        if "writing" in steps:
            print(f"  training step, nothing in flight: {fmt(steps['idle']['median'])} (n={steps['idle']['n']}); "
                  f"while an async write is in flight: {fmt(steps['writing']['median'])} "
                  f"(n={steps['writing']['n']}, {steps['writing']['median'] / steps['idle']['median'] - 1:+.0%})")
        print(f"  machine load average: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
        results.update(file_bytes=bench.file_bytes, stall={"sync": sync, "async": asyn}, ratio=ratio,
                       within_10pct=within, stall_cpu=cpu, steps=steps,
                       raw={"stall": bench.stall, "waited": bench.waited, "fsync": bench.fsync,
                            "steps": bench.step_times})

        print(f"\nbreakdown of an async save's stall (each part alone; median and min of {args.breakdown_reps}):")
        parts = breakdown(trainer, plugin, args.breakdown_reps)
        meta = parts.pop("_meta")
        for name, st in parts.items():
            print(f"  {name:52s} {fmt(st['median'])} (min {fmt(st['min']).strip()})")
        print(f"  (tensors staged: {meta['staged_bytes'] / 1e6:.1f} MB)")
        results["breakdown"] = parts

        if args.fit_steps:
            times = fit_times(model, data, directory, args.fit_steps, args.every, args.fit_repeats)
            med = {m: statistics.median(v) for m, v in times.items()}
            print(f"\nfits of {args.fit_steps} steps, saving every {args.every} steps (median of {args.fit_repeats}):")
            for m in times:
                extra = "" if m == "none" else f"  (+{med[m] / med['none'] - 1:.0%} over no saves)"
                print(f"  {m:6s} {med[m]:8.2f} s  [{min(times[m]):.2f} .. {max(times[m]):.2f}]{extra}")
            fit_ratio = med["async"] / med["sync"]
            print(f"  async fit / sync fit: {fit_ratio:.2f}  (target <= 1.00: {'met' if fit_ratio <= 1.0 else 'NOT MET'})")
            results["fits"] = {"times": times, "ratio": fit_ratio}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        os.fsync = _real_fsync
        plugin.wait()
        atomic.wait_for_cleanup()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
