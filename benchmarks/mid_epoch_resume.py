"""Resuming inside an epoch costs the same wherever the save stood: time from process start to the first resumed
training step, for a save at 5% and at 95% of a one-epoch run of 20,000 small batches (issue 38).

    python benchmarks/mid_epoch_resume.py                  # 20,000 batches, 3 resumes from each point
    python benchmarks/mid_epoch_resume.py --batches 4000 --repeats 2    # quick look

A shuffled ``DataLoader`` over a map-style dataset whose items cost real work to load (``--item-us`` of busy work
each, as decoding a sample does) trains a tiny module under a real ``Trainer`` with ``OrtCheckpoint``, which saves
at 5% and at 95% of the epoch. Each resume is a fresh process (as after a preemption), timed from its start to the
start of the first training step, and, inside it, from the ``fit`` call; the two points alternate. The data position
makes the resumed iterator skip the trained batches at the sampler, so no skipped item is loaded: target, the 95%
resume within 10% of the 5% one, process start to first step. For scale, the same run reads the trained batches
through the loader (what a fast-forward by reading would cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_ort_ckpt import OrtCheckpoint


class Costly(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, n: int, item_us: float) -> None:
        self.n, self.item_s = n, item_us / 1e6

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        end = time.perf_counter() + self.item_s
        while time.perf_counter() < end:
            pass
        return torch.tensor([float(i)])


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.first_step: float | None = None

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.first_step is None:
            self.first_step = time.perf_counter()
        return self.layer(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def loader(args: argparse.Namespace) -> torch.utils.data.DataLoader[torch.Tensor]:
    return torch.utils.data.DataLoader(Costly(args.batches * 4, args.item_us), batch_size=4, shuffle=True)


def trainer(dirpath: Path, max_steps: int, every: int | None = None) -> pl.Trainer:
    saving = OrtCheckpoint(dirpath=dirpath, every_n_train_steps=every, save_top_k=-1) if every else \
        OrtCheckpoint(dirpath=dirpath, save_top_k=0)
    return pl.Trainer(max_steps=max_steps, max_epochs=1, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[saving])


def resume(args: argparse.Namespace) -> None:
    """In a fresh process: fit from ``--resume`` to one step past it; print when fit started and when it stepped."""
    model, fit_called = Tiny(), time.time()
    t = trainer(Path(args.resume).parent.parent / "resumed", args.at + 1)
    t.fit(model, loader(args), ckpt_path=args.resume)
    assert model.first_step is not None and t.global_step == args.at + 1
    print(json.dumps({"fit": fit_called, "first_step": time.time() - (time.perf_counter() - model.first_step)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--item-us", type=float, default=25.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--resume", help=argparse.SUPPRESS)
    parser.add_argument("--at", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resume:
        return resume(args)
    early, late = args.batches // 20, args.batches * 19 // 20
    with tempfile.TemporaryDirectory() as tmp:
        saves = Path(tmp) / "ckpts"
        pl.seed_everything(0)
        start = time.perf_counter()
        trainer(saves, late, every=early).fit(Tiny(), loader(args))
        print(f"the run to {late} steps (saves every {early}): {time.perf_counter() - start:.1f} s")
        paths = {point: next(saves.glob(f"*-step={point}.ckpt")) for point in (early, late)}
        total: dict[int, list[float]] = {early: [], late: []}
        in_fit: dict[int, list[float]] = {early: [], late: []}
        for _ in range(args.repeats):
            for point, path in paths.items():
                begin = time.time()
                out = subprocess.run([sys.executable, __file__, "--resume", str(path), "--at", str(point),
                                      "--batches", str(args.batches), "--item-us", str(args.item_us)],
                                     check=True, capture_output=True, text=True).stdout
                times = json.loads(out.strip().splitlines()[-1])
                total[point].append(times["first_step"] - begin)
                in_fit[point].append(times["first_step"] - times["fit"])
        data = loader(args)
        begin, it = time.perf_counter(), iter(data)
        for _ in range(late):
            next(it)
        read_late = time.perf_counter() - begin
    print(f"median of {args.repeats} fresh processes each:        process start -> step   fit() -> step")
    for point, share in ((early, "5%"), (late, "95%")):
        print(f"  saved at {point:6d} of {args.batches} batches ({share:>3}): {statistics.median(total[point]):10.3f} s"
              f" {statistics.median(in_fit[point]) * 1000:12.1f} ms")
    ratio = statistics.median(total[late]) / statistics.median(total[early])
    print(f"ratio 95% / 5%, process start to first step: {ratio:.3f} (target <= 1.10: "
          f"{'met' if ratio <= 1.10 else 'MISSED'})")
    print(f"for scale, reading the {late} trained batches through the loader: {read_late:.2f} s")


if __name__ == "__main__":
    main()
