"""Training-loop stall per checkpoint save with ``OrtCheckpointIO(async_save=True)``, against a synchronous save of the
same state.

    python benchmarks/async_stall.py                     # 25M float32 parameters, AdamW state, 5 saves per mode
    python benchmarks/async_stall.py --params-m 5 --saves 3

A ``LightningModule`` of ``--params-m`` million float32 parameters (an embedding-free MLP stack: blocks of
``Linear(d, 4d)``, ``Linear(4d, d)`` and ``LayerNorm``) trains with AdamW under a real ``Trainer`` (CPU, one device)
whose checkpoint plugin is ``OrtCheckpointIO``. After a few warm-up steps a callback, at ``on_train_batch_end`` as
``ModelCheckpoint`` does, calls ``trainer.save_checkpoint`` alternately with ``async_save`` off and on (the same
plugin object: only the attribute changes, so both modes save the same state at neighbouring steps) and measures:

* **stall**: wall time the training thread spends inside ``trainer.save_checkpoint``. For a synchronous save that
  is the whole save, fsync and atomic rename included; for an asynchronous one, the time until the call returns
  (training may then change its tensors);
* **durable** (async only): from the call until ``checkpoint_io.wait()`` returns, i.e. the file is fsynced and
  renamed into place (training is paused in ``wait()`` here, so this is the write alone, not slowed by training);
* **steps while writing** (async only): after a few more async saves, training goes on without waiting; the steps
  that start while the background write is in flight are timed against steps with no write in flight.

Between saves (outside every timed region) the previous save is waited for, its file deleted, the deletion awaited
(``atomic.wait_for_cleanup``) and the page cache flushed (``os.sync``): replacing multi-GB files is slow on this
disk and must not land in a timed save. The median (and min/max) over ``--saves`` saves per mode is reported, with
the ratio async stall / sync stall (target: under 10%).

The breakdown times each part of an asynchronous save separately, on the same state, median of a few repetitions:
Lightning's ``dump_checkpoint``, the plugin's owner lookup (``_owner_strategy``: the strategy bound in ``setup``),
``ModuleInfo.from_module``, RNG capture, ``to_ort``, and the staging copy (``OrtCheckpointIO._stage``: into
the previous save's buffers once that save is written, else fresh CPU memory),
next to a plain copy of the same tensors into fresh and into reused memory. ``--cprofile`` adds a cProfile of one
async save call.

Reading the numbers: nearly all of an async stall is the staging copy, and most of that is first-touch page faults
of the fresh staging memory (a copy into reused memory is several times cheaper). Whether a save gets fresh pages
depends on the allocator's state, so async stalls vary a lot between saves; on a machine shared with other busy
processes every number here (memcpy included) is inflated and noisy: check the load average printed with the
results.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
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

from lightning_ort_ckpt import rng
from lightning_ort_ckpt.format import atomic
from lightning_ort_ckpt.plugin import RNG_KEY, OrtCheckpointIO
from lightning_ort_ckpt.translation.lightning import ModuleInfo, to_ort

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

    def __init__(self, plugin: OrtCheckpointIO, directory: str, saves: int, warmup: int, overlap: int) -> None:
        self.plugin, self.directory, self.saves, self.warmup = plugin, directory, saves, warmup
        self.stall: dict[str, list[float]] = {"sync": [], "async": []}
        self.stall_cpu: dict[str, list[float]] = {"sync": [], "async": []}  # the training thread's CPU time
        self.fsync: dict[str, list[float]] = {"sync": [], "async": []}  # of which in os.fsync (async: in the worker)
        self.durable: list[float] = []
        self.step_times: dict[str, list[float]] = {"idle": [], "writing": []}
        self.plan = [m for _ in range(saves) for m in ("sync", "async")] + ["overlap"] * overlap
        self._step_start = 0.0
        self._skip_step = False  # the step whose end ran a save or a cleanup: not a plain training step
        self._started_writing = False
        self._in_flight_path: str | None = None
        self.file_bytes = 0
        self.done = False

    def _writing(self) -> bool:
        """Whether the plugin's background worker has a task queued or running (private state, read only)."""
        jobs = getattr(getattr(self.plugin, "_worker", None), "_queue", None)
        return bool(jobs is not None and jobs.unfinished_tasks)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._started_writing = self._writing()
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        elapsed = time.perf_counter() - self._step_start
        if trainer.global_step <= self.warmup or self._skip_step:
            self._skip_step = False
            return
        if self._in_flight_path is not None:
            if self._started_writing:  # a step that began while the background write was in flight
                self.step_times["writing"].append(elapsed)
            if self._writing():
                return
            self._finish(self._in_flight_path)  # the overlapped write is durable: clean up, untimed
            self._in_flight_path = None
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
        self.plugin.async_save = mode != "sync"
        gc.collect()  # not inside the timed region: a collection there would be noise, not the save's cost
        _FSYNC["seconds"] = 0.0
        c0, t0 = time.thread_time(), time.perf_counter()
        trainer.save_checkpoint(path)
        t1, c1 = time.perf_counter(), time.thread_time()
        if mode == "overlap":  # let training run on while the background write is in flight
            self._in_flight_path = path
            return
        self.stall[mode].append(t1 - t0)
        self.stall_cpu[mode].append(c1 - c0)
        if mode == "async":
            self.plugin.wait()
            self.durable.append(time.perf_counter() - t0)
        self.fsync[mode].append(_FSYNC["seconds"])
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
    for _ in range(reps):
        checkpoint = timed("lightning dump_checkpoint", lambda: trainer._checkpoint_connector.dump_checkpoint(False))
        timed("plugin _owner_strategy (as in a save)", lambda: plugin._owner_strategy(checkpoint["state_dict"]))
        info = timed("ModuleInfo.from_module", lambda: ModuleInfo.from_module(module, list(strategy.optimizers)))
        states = timed("rng.capture", rng.capture)
        ck = timed("to_ort", lambda: to_ort({**checkpoint, RNG_KEY: states}, info,
                                            ort_compatible=plugin.ort_compatible))
        staged = timed("plugin _stage (into the previous save's buffers)", lambda: plugin._stage(ck))
        del staged
        fresh = timed("baseline: plain copy into fresh memory", lambda: [t.detach().clone() for t in tensors])
        del fresh
        timed("baseline: copy into reused memory", lambda: [r.copy_(t) for r, t in zip(reused, tensors)])
    parts_stats = {name: median_stats(v) for name, v in parts.items()}
    parts_stats["_meta"] = {"gc_tracked_objects": len(gc.get_objects()),
                            "staged_bytes": sum(t.numel() * t.element_size() for t in tensors)}
    return parts_stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-m", type=float, default=25.0, help="model size, millions of float32 parameters")
    ap.add_argument("--saves", type=int, default=5, help="timed saves per mode (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="training steps before the first save")
    ap.add_argument("--breakdown-reps", type=int, default=5, help="repetitions of the per-part timing")
    ap.add_argument("--overlap-saves", type=int, default=3,
                    help="async saves during which training steps are timed (0: skip)")
    ap.add_argument("--cprofile", action="store_true", help="also print a cProfile of one async save call")
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
    plugin = OrtCheckpointIO()
    bench = SaveBench(plugin, directory, args.saves, args.warmup, args.overlap_saves)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=100_000, max_epochs=-1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[plugin], callbacks=[bench])
    print(f"model: {n_params / 1e6:.2f}M float32 parameters ({len(model.blocks)} blocks of width {WIDTH}), AdamW; "
          f"checkpoints in {directory}", flush=True)
    os.fsync = _timed_fsync  # the format layer calls os.fsync: time it (only this process, only this run)
    try:
        trainer.fit(model, DataLoader(data, batch_size=BATCH))
        assert bench.done, "training stopped before the saves were done"

        sync, asyn, durable = (median_stats(bench.stall["sync"]), median_stats(bench.stall["async"]),
                               median_stats(bench.durable))
        ratio = asyn["median"] / sync["median"]
        print(f"\ncheckpoint file: {bench.file_bytes / 1e6:.1f} MB ({bench.file_bytes / 1e6 / n_params * 1e6:.1f} "
              f"bytes per parameter); {args.saves} saves per mode, median [min .. max]")
        fsync = {m: median_stats(v) for m, v in bench.fsync.items()}
        for label, s in (("sync stall (whole save, fsync incl.)", sync), ("  of which in fsync", fsync["sync"]),
                         ("async stall (save call returns)", asyn), ("async end-to-end until durable", durable),
                         ("  of which in fsync (worker thread)", fsync["async"])):
            print(f"  {label:40s} {fmt(s['median'])}  [{fmt(s['min'])} .. {fmt(s['max'])}]")
        print(f"  async stall / sync stall: {ratio:.1%}  (target < 10%: {'met' if ratio < 0.10 else 'MISSED'})")
        cpu = {m: median_stats(v) for m, v in bench.stall_cpu.items()}
        print(f"  training thread CPU time inside the call: sync {fmt(cpu['sync']['median'])}, async "
              f"{fmt(cpu['async']['median'])} (wall minus CPU: waiting for the disk, or for a CPU on a busy machine)")
        print(f"  machine load average during the run: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
        print(f"  sync write throughput: {bench.file_bytes / sync['median'] / 1e6:.0f} MB/s; async durable: "
              f"{bench.file_bytes / durable['median'] / 1e6:.0f} MB/s")
        steps = {k: median_stats(v) for k, v in bench.step_times.items() if v}
        if "writing" in steps:
            print(f"  training step, nothing in flight: {fmt(steps['idle']['median'])} (n={steps['idle']['n']}); "
                  f"while an async write is in flight: {fmt(steps['writing']['median'])} "
                  f"(n={steps['writing']['n']}, +{steps['writing']['median'] / steps['idle']['median'] - 1:.0%})")

        print(f"\nbreakdown of an async save's stall (each part alone; median and min of {args.breakdown_reps}):")
        parts = breakdown(trainer, plugin, args.breakdown_reps)
        meta = parts.pop("_meta")
        for name, s in parts.items():
            share = "" if name.startswith(("baseline", "  ")) else f"  {s['median'] / asyn['median']:6.1%} of the stall"
            print(f"  {name:45s} {fmt(s['median'])} (min {fmt(s['min']).strip()}){share}")
        print(f"  (gc-tracked objects in this process: {meta['gc_tracked_objects']:,}; tensors staged: "
              f"{meta['staged_bytes'] / 1e6:.1f} MB)")
        print("  note: staging into fresh memory costs a copy plus first-touch page faults, unless the allocator hands "
              "back memory freed by an earlier save (then it costs about the reused-memory baseline): its time varies "
              "from save to save, and with the machine's load")

        profile_text = None
        if args.cprofile:
            plugin.async_save = True
            profiler = cProfile.Profile()
            gc.collect()
            profiler.enable()
            trainer.save_checkpoint(os.path.join(directory, "profiled.ckpt"))
            profiler.disable()
            plugin.wait()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(18)
            profile_text = out.getvalue()
            print("\ncProfile of one async save call:\n" + profile_text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": sys.argv, "params": n_params, "file_bytes": bench.file_bytes,
                           "stall": {"sync": sync, "async": asyn}, "durable": durable, "ratio": ratio,
                           "stall_cpu": cpu, "fsync": fsync, "loadavg": os.getloadavg(),
                           "raw": {"stall": bench.stall, "stall_cpu": bench.stall_cpu, "durable": bench.durable,
                                   "fsync": bench.fsync, "steps": bench.step_times},
                           "steps": steps, "breakdown": parts, "meta": meta}, f, indent=1)
    finally:
        os.fsync = _real_fsync
        plugin.wait()
        atomic.wait_for_cleanup()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
