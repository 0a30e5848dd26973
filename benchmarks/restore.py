"""What a resume costs against a raw read of the same bytes (issue 39, point 6): ``fit(ckpt_path=...)`` on a
25M-parameter model with AdamW, from our checkpoint and from Lightning's own (``torch.save``), in the same run.

    python benchmarks/restore.py                    # 25M parameters, 5 rounds
    python benchmarks/restore.py --params 5 --rounds 3      # quick look

A real ``Trainer`` fits a transformer-like stack of ``Linear`` layers (``--params`` million float32 parameters) with
AdamW for one step and saves it twice: with ``OrtCheckpoint`` (checksums on, as by default) and with Lightning's
``ModelCheckpoint`` (``torch.save``). Each measurement is a fresh process (as after a preemption) that builds the
model and a Trainer, then times ``fit`` up to the start of the first training step: with ``ckpt_path`` set to one
of the two files, and without a checkpoint (what a start from scratch costs: the Trainer's own set-up). The restore
is the difference: reading, checking and placing the weights, the optimizer state and the loops. The baseline is a
raw ``readinto`` of the same bytes from the same folder into fresh memory. Before every measurement, restores and
raw reads alike, the files are put in the same state: read once (``--cache warm``, the default: the fast-tier case,
a local disk or ``/dev/shm`` just written) or dropped from the page cache (``--cache cold``: a fresh machine's disk).
Target: our restore within 1.3x the raw read. Methods alternate within each round; medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytorch_lightning as pl
import torch

from lightning_ort_ckpt import OrtCheckpoint


class Stack(pl.LightningModule):
    def __init__(self, params_m: float) -> None:
        super().__init__()
        width = 512
        layers = max(1, round(params_m * 1e6 / (width * width + width)))
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
        self.first_step: float | None = None

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.first_step is None:
            self.first_step = time.perf_counter()
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _loader() -> torch.utils.data.DataLoader[list[torch.Tensor]]:
    data = torch.randn(8, 512, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)


def _trainer(callback: pl.Callback, max_steps: int) -> pl.Trainer:
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=[callback])


def _write(directory: Path, params_m: float) -> dict[str, list[str]]:
    """The two checkpoints of the same one-step fit; each one's files."""
    files = {}
    for kind in ("ours", "lightning"):
        pl.seed_everything(0, verbose=False)
        folder = directory / kind
        callback = OrtCheckpoint(dirpath=folder) if kind == "ours" else \
            pl.callbacks.ModelCheckpoint(dirpath=folder)
        _trainer(callback, 1).fit(Stack(params_m), _loader())
        files[kind] = sorted(str(p) for p in folder.iterdir())
    return files


def _child(args: argparse.Namespace) -> None:
    """In a fresh process: seconds from ``fit`` to the first training step (from ``--ckpt``, or from scratch)."""
    model = Stack(args.params)
    callback = OrtCheckpoint(dirpath=args.out) if args.kind == "ours" else \
        pl.callbacks.ModelCheckpoint(dirpath=args.out)
    trainer = _trainer(callback, 2)
    start = time.perf_counter()
    trainer.fit(model, _loader(), ckpt_path=args.ckpt or None)
    assert model.first_step is not None
    print(json.dumps({"seconds": model.first_step - start}))


def set_cache(files: list[str], warm: bool) -> None:
    """Every byte of ``files`` in the page cache (``warm``), or none of them."""
    for name in files:
        with open(name, "rb") as f:
            if warm:
                while f.read(64 << 20):
                    pass
            else:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _raw_read(files: list[str]) -> float:
    """Seconds to read ``files`` into fresh memory, as a loader must."""
    start = time.perf_counter()
    for name in files:
        buffer = bytearray(os.path.getsize(name))
        with open(name, "rb", buffering=0) as f:
            view, done = memoryview(buffer), 0
            while done < len(buffer):
                done += f.readinto(view[done:]) or len(buffer)
    return time.perf_counter() - start


def _measure(args: argparse.Namespace, kind: str, ckpt: str, out: Path, files: list[str]) -> float:
    set_cache(files, args.cache == "warm")
    command = [sys.executable, __file__, "--child", "--kind", kind, "--params", str(args.params), "--out", str(out)]
    result = subprocess.run([*command, "--ckpt", ckpt], check=True, capture_output=True, text=True)
    return float(json.loads(result.stdout.strip().splitlines()[-1])["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25, help="million parameters (default 25)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache", choices=("warm", "cold"), default="warm",
                        help="the files' page-cache state before each measurement (default: warm)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    with tempfile.TemporaryDirectory(prefix="restore-bench-") as tmp:
        directory = Path(tmp)
        files = _write(directory, args.params)
        ckpts = {kind: next(f for f in names if f.endswith(".ckpt")) for kind, names in files.items()}
        times: dict[str, list[float]] = {k: [] for k in ("scratch", "ours", "lightning", "raw ours",
                                                        "raw lightning")}
        size = {kind: sum(os.path.getsize(f) for f in names) for kind, names in files.items()}
        for _ in range(args.rounds):
            times["scratch"].append(_measure(args, "ours", "", directory / "scratch", []))
            for kind in ("ours", "lightning"):
                times[kind].append(_measure(args, kind, ckpts[kind], directory / f"resumed-{kind}", files[kind]))
                set_cache(files[kind], args.cache == "warm")
                times[f"raw {kind}"].append(_raw_read(files[kind]))
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.params:g}M parameters + AdamW ({size['ours'] / 1e6:.1f} MB ours, {size['lightning'] / 1e6:.1f} MB "
          f"torch.save), page cache {args.cache}, {args.rounds} rounds, medians (min-max):")
    for k, v in times.items():
        print(f"  {k:14s} {median[k]:.3f} s ({min(v):.3f}-{max(v):.3f})")
    for kind in ("ours", "lightning"):
        restore = median[kind] - median["scratch"]
        print(f"  restore, {kind}: {restore:.3f} s = {restore / median[f'raw {kind}']:.2f}x its raw read")
    ratio = (median["ours"] - median["scratch"]) / median["raw ours"]
    print(f"target: our restore <= 1.3x the raw read: {'met' if ratio <= 1.3 else 'NOT met'} ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
