"""Training-loop stall of checkpoint saves on a GPU (issue 22): ours (sync, async), Lightning's ``TorchCheckpointIO``
and ``AsyncCheckpointIO``, DCP ``async_save``, against the floor of copying the same bytes off the GPU.

    python benchmarks/gpu_stall.py                                   # 400M parameters, fused AdamW, bf16-mixed
    python benchmarks/gpu_stall.py --params-m 100 --steps 400 --every 100
    python benchmarks/gpu_stall.py --cpu --params-m 2 --steps 24 --every 6 --batch 16 --width 256   # CPU smoke run

Without a CUDA GPU it says so and exits 0, unless ``--cpu`` asks for the same table on CPU tensors (a smoke run:
the GPU targets are not judged there).

Each mode runs in a fresh process (a first save meets fresh memory, as in a real run): a ``LightningModule`` of
``--params-m`` million parameters (blocks of ``Linear(d, 4d)``, ``Linear(4d, d)``, ``LayerNorm``; width ``--width``)
trains ``--steps`` steps with ``AdamW(fused=True)`` under a real ``Trainer`` (``--precision``), saving every
``--every`` steps into two files in turn (each save replaces an older file). Modes:

* ``none``: no saves (the fit time and peak GPU memory the others are compared with);
* ``ours sync`` / ``ours async``: ``OrtCheckpointIO()`` / ``OrtCheckpointIO(async_save=True)``; and ``ours async,
  nothing ahead``: the same with the staging memory allocated by the first save itself (as before issue 22);
* ``lightning torch`` / ``lightning async``: ``TorchCheckpointIO`` / ``AsyncCheckpointIO(TorchCheckpointIO())``;
* ``dcp async_save``: ``torch.distributed.checkpoint.async_save`` of the module's and optimizer's state dicts
  (``no_dist``), from the same callback; a save first waits for the previous one's future.

The **stall** of a save is what training loses to it: the time in the save call, plus how much longer than the
median step (of the same run, away from saves) each of the ``--after`` steps that follow it took. Each step is timed
to the end of its GPU work on the training stream (``current_stream().synchronize()``: the side stream of our copies
is not waited for there, so overlap is kept). For our asynchronous modes it also prints the call plus the time
optimizer steps blocked the CPU waiting for that save's copies (``async_stall.py``'s measure: on a GPU the wait is
on the device, so this is the call alone; on CPU it is the part of the stall that step-time noise does not blur).
The floors, timed in a process of their own on the same state (the
module's tensors and AdamW's state, as the checkpoint holds them): a device-to-host copy into pinned memory
(``non_blocking``, then synchronized), and into pageable memory, fresh and reused.

Targets (issue 22, judged on a GPU, ratios taken in the same run): every save's stall, the first included, <= 2x
the pinned copy; the fit with async saves within 5% of the fit without; peak GPU memory not above the run without
saves plus one chunk (the largest tensor of the state).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

MODES = {
    "none": "no saves",
    "ours_sync": "ours sync (OrtCheckpointIO)",
    "ours_async": "ours async (async_save=True)",
    "ours_async_late": "ours async, nothing ahead",
    "lightning_torch": "Lightning TorchCheckpointIO",
    "lightning_async": "Lightning AsyncCheckpointIO",
    "dcp_async": "DCP async_save",
}


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and its data (seeded: every mode trains the same)."""
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Mlp(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            d = args.width
            blocks = max(1, round(args.params_m * 1e6 / (8 * d * d + 7 * d)))
            self.blocks = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d),
                                                       "norm": nn.LayerNorm(d)}) for _ in range(blocks))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            for b in self.blocks:
                x = b["norm"](x + b["down"](nn.functional.gelu(b["up"](x))))
            return nn.functional.mse_loss(x.float(), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=True)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(args.batch * 4, args.width), torch.randn(args.batch * 4, args.width))
    return Mlp(), DataLoader(data, batch_size=args.batch)


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One mode's fit, in this (fresh) process."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from lightning_ort_ckpt import BindCheckpointIO, OrtCheckpointIO
    from lightning_ort_ckpt._saving import _staging

    cuda = not args.cpu
    try:  # Lightning imports it in its first dump_checkpoint (hyperparameters): a cost of the process, not of a save
        import omegaconf  # noqa: F401
    except ImportError:
        pass
    directory = tempfile.mkdtemp(prefix=f"gpu_stall-{mode}-", dir=args.dir)
    model, loader = build(args)
    plugin: Any = None
    if mode.startswith("ours"):
        plugin = OrtCheckpointIO(async_save=mode != "ours_sync")
        if mode == "ours_async_late":
            plugin._stager.prepare = lambda sources: None  # benchmark-only: the behaviour before issue 22
    elif mode == "lightning_torch":
        plugin = TorchCheckpointIO()
    elif mode == "lightning_async":
        plugin = AsyncCheckpointIO(TorchCheckpointIO())
    waited = {"s": 0.0}
    real_wait = _staging.Stager._wait_for_copies

    def timed_wait(*a: Any) -> None:  # the time optimizer steps block the CPU for our deferred copies
        t0 = time.perf_counter()
        real_wait(*a)
        waited["s"] += time.perf_counter() - t0

    _staging.Stager._wait_for_copies = timed_wait  # type: ignore[method-assign]

    class Saver(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.saves: list[tuple[int, float]] = []  # (index of the step it followed, seconds in the call)
            self.waits: list[float] = []  # ours: optimizer steps blocked on the CPU for each save's copies
            self.future: Any = None
            self.t0 = 0.0

        def _sync(self) -> None:
            if cuda:
                torch.cuda.current_stream().synchronize()

        def on_train_batch_start(self, trainer: pl.Trainer, *a: Any) -> None:
            self._sync()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *a: Any) -> None:
            self._sync()
            self.steps.append(time.perf_counter() - self.t0)
            if mode == "none" or trainer.global_step % args.every:
                return
            path = os.path.join(directory, f"ckpt-{trainer.global_step // args.every % 2}")
            if self.saves:
                self.waits.append(waited["s"] - sum(self.waits))
            t0 = time.perf_counter()
            if mode == "dcp_async":
                import torch.distributed.checkpoint as dcp
                if self.future is not None:
                    self.future.result()
                state = {"model": module.state_dict(), "optim": trainer.optimizers[0].state_dict()}
                self.future = dcp.async_save(state, checkpoint_id=path, no_dist=True)
            else:
                trainer.save_checkpoint(path + ".ckpt")
            self.saves.append((len(self.steps) - 1, time.perf_counter() - t0))

        def on_train_end(self, trainer: pl.Trainer, *a: Any) -> None:
            self.waits.append(waited["s"] - sum(self.waits))
            if self.future is not None:
                self.future.result()

    saver = Saver()
    callbacks = [saver, BindCheckpointIO()] if mode.startswith("ours") else [saver]  # ours: bound to the Trainer
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_steps=args.steps,
                         precision=args.precision, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         plugins=[plugin] if plugin is not None else None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.fit(model, loader)
    fit = time.perf_counter() - t0
    near = {i + j for i, _ in saver.saves for j in range(1, args.after + 1)}
    plain = [s for i, s in enumerate(saver.steps) if i >= args.warmup and i not in near]
    median_step = statistics.median(plain) if plain else 0.0
    stalls = [call + sum(max(0.0, saver.steps[i + j] - median_step)
                         for j in range(1, args.after + 1) if i + j < len(saver.steps))
              for i, call in saver.saves]
    state = [*model.state_dict().values(),
             *[v for s in trainer.optimizers[0].state.values() for v in s.values() if isinstance(v, torch.Tensor)]]
    with open("/proc/self/status") as f:
        vmhwm = int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024
    return {"mode": mode, "fit_s": fit, "median_step_s": median_step, "stalls_s": stalls,
            "calls_s": [c for _, c in saver.saves], "waits_s": saver.waits[:len(saver.saves)], "waited_s": waited["s"],
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None, "vmhwm_bytes": vmhwm,
            "chunk_bytes": max(t.numel() * t.element_size() for t in state)}


def run_floors(args: argparse.Namespace) -> dict[str, Any]:
    """The copy floors on the state a checkpoint holds (module tensors and AdamW's state after one step)."""
    import torch

    cuda = not args.cpu
    model, loader = build(args)
    device = torch.device("cuda" if cuda else "cpu")
    model.to(device)
    optimizer = model.configure_optimizers()
    x, y = next(iter(loader))
    model.training_step((x.to(device), y.to(device)), 0).backward()
    optimizer.step()
    tensors = [t.detach() for t in model.state_dict().values()]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn: Any) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    out: dict[str, Any] = {"state_bytes": nbytes}
    if cuda:
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        out["pinned_s"] = [timed(lambda: [p.copy_(t, non_blocking=True) for p, t in zip(pinned, tensors)])
                           for _ in range(args.repeats)]
        del pinned
    fresh = []
    for _ in range(args.repeats):
        fresh.append(timed(lambda: [t.to("cpu", copy=True) for t in tensors]))
    out["fresh_s"] = fresh
    reused = [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]
    out["reused_s"] = [timed(lambda: [r.copy_(t) for r, t in zip(reused, tensors)]) for _ in range(args.repeats)]
    return out


def child(args: argparse.Namespace) -> list[str]:
    """The arguments that make a child process run the same configuration."""
    keep = ["--params-m", str(args.params_m), "--width", str(args.width), "--batch", str(args.batch),
            "--steps", str(args.steps), "--every", str(args.every), "--after", str(args.after),
            "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--precision", args.precision,
            "--dir", args.dir]
    return [sys.executable, os.path.abspath(__file__), *keep, *(["--cpu"] if args.cpu else [])]


def fmt(s: float) -> str:
    return f"{s:.3f} s" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-m", type=float, default=400.0, help="model size, millions of parameters")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2048, help="rows per batch")
    ap.add_argument("--steps", type=int, default=800, help="training steps of each fit")
    ap.add_argument("--every", type=int, default=200, help="save every N steps")
    ap.add_argument("--after", type=int, default=2, help="steps after a save counted in its stall")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the median step")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of each floor copy")
    ap.add_argument("--precision", default=None, help="Trainer precision (default: bf16-mixed on GPU, 32-true on CPU)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--cpu", action="store_true", help="run the table on CPU tensors (a smoke run)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # a child process: this mode (or "floors")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.precision = args.precision or ("32-true" if args.cpu else "bf16-mixed")
    warnings.filterwarnings("ignore")

    if args.mode is not None:
        result = run_floors(args) if args.mode == "floors" else run_mode(args, args.mode)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0

    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_stall: no CUDA GPU here (torch.cuda.is_available() is False): nothing measured. "
              "--cpu runs the same table on CPU tensors as a smoke run.")
        return 0
    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    device = "CPU (smoke run)" if args.cpu else torch.cuda.get_device_name()
    print(f"device: {device}; {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"precision {args.precision}")
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="gpu_stall-")
    results: dict[str, Any] = {"device": device, "args": vars(args)}
    for mode in ["floors", *args.modes]:
        out = os.path.join(args.dir, f"{mode}.json")
        proc = subprocess.run([*child(args), "--mode", mode, "--out", out], capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"  {mode}: failed\n{proc.stderr[-3000:]}")
            continue
        with open(out) as f:
            results[mode] = json.load(f)
    if own_dir:
        import shutil

        shutil.rmtree(args.dir, ignore_errors=True)

    floors = results.get("floors", {})
    gb = floors.get("state_bytes", 0) / 1e9
    print(f"\nstate: {gb:.2f} GB (module tensors and AdamW state); a save every {args.every} of {args.steps} steps")
    floor = statistics.median(floors["pinned_s"]) if "pinned_s" in floors else None
    for key, label in (("pinned_s", "floor: pinned device-to-host copy"), ("fresh_s", "pageable copy, fresh memory"),
                       ("reused_s", "pageable copy, reused memory")):
        if key in floors:
            print(f"  {label:40s} {fmt(statistics.median(floors[key]))}  (each: "
                  + ", ".join(fmt(s) for s in floors[key]) + ")")
    print(f"\n| mode | stall, first save | stall, later saves (median; max) | fit (s) | peak GPU memory | peak host |")
    print("|---|---|---|---|---|---|")
    for mode in args.modes:
        r = results.get(mode)
        if r is None:
            continue
        st = r["stalls_s"]
        first = fmt(st[0]) if st else "-"
        later = f"{fmt(statistics.median(st[1:]))}; {fmt(max(st[1:]))}" if len(st) > 1 else "-"
        gpu = f"{r['peak_gpu_bytes'] / 2**30:.2f} GiB" if r["peak_gpu_bytes"] is not None else "-"
        print(f"| {MODES[mode]} | {first} | {later} | {r['fit_s']:.2f} | {gpu} | {r['vmhwm_bytes'] / 2**30:.2f} GiB |")

    for mode in ("ours_async", "ours_async_late"):
        r = results.get(mode)
        if r and r["calls_s"]:
            each = [c + w for c, w in zip(r["calls_s"], r["waits_s"])]
            print(f"{MODES[mode]}: the call plus the optimizer steps' CPU wait for its copies, first save "
                  f"{fmt(each[0])}, later " + ", ".join(fmt(e) for e in each[1:]))
    ours, none = results.get("ours_async"), results.get("none")
    if ours and none:
        fit_ratio = ours["fit_s"] / none["fit_s"]
        print(f"\nours async: fit {fit_ratio:.3f}x the fit without saves; optimizer steps blocked on the CPU "
              f"{fmt(ours['waited_s'])} in all for deferred copies")
        if args.cpu:
            print("(CPU smoke run: the GPU targets are not judged here)")
        elif floor is not None:
            worst = max(ours["stalls_s"]) / floor if ours["stalls_s"] else 0.0
            first = ours["stalls_s"][0] / floor if ours["stalls_s"] else 0.0
            extra = (ours["peak_gpu_bytes"] - none["peak_gpu_bytes"]) / ours["chunk_bytes"]
            verdict = {"every stall <= 2x the pinned copy": worst <= 2.0,
                       "fit within 5% of no saves": fit_ratio <= 1.05,
                       "GPU memory <= no saves + one chunk": extra <= 1.0}
            print(f"  first save's stall {first:.2f}x the floor, worst {worst:.2f}x; GPU memory "
                  f"{extra:+.2f} chunks over no saves")
            for name, met in verdict.items():
                print(f"  target: {name}: {'met' if met else 'NOT MET'}")
            results["verdict"] = verdict
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
