"""Fine-tuning saves with frozen-tensor sharing (``share_frozen``), against whole writes and Lightning's default.

    python benchmarks/frozen_sharing.py                          # 251M frozen + 13M trainable, 6 saves + last
    python benchmarks/frozen_sharing.py --frozen-m 20 --saves 4  # quick look
    python benchmarks/frozen_sharing.py --runs "one copy (old)"  # sharing (always) against one other run

A ``LightningModule`` with a frozen backbone of ``--frozen-m`` million float32 parameters (a token embedding, two
``Linear(1024, 1024)`` layers and a ``BatchNorm1d`` whose running statistics change every step) and a trainable head
of about 5% of that (``Linear(1024, n)``) trains with AdamW under a real ``Trainer`` (CPU). The checkpoint callback
saves every ``--every`` steps with ``save_top_k=3`` (a logged score that rises, so every save enters the top 3 and
the oldest rotates out) and ``save_last=True`` (a copy, itself a save). Five runs from the same state:

* **sharing**: ``OrtCheckpoint(share_frozen=True)`` (the default): unchanged frozen tensors stay in ``.data`` files
  that later saves hard-link, each save hashing what it links against the recorded checksums; two independent copies
  (consecutive saves alternate), a fresh copy after ``LINKS_PER_COPY`` links, a copy read back from disk before it is
  linked when its identity changed and every ``VERIFY_EVERY`` saves (issue 24); the second copy, the renewals and
  the periodic read-backs on the plugin's background thread, outside the timed save calls;
* **one copy (old)**: the same with the sharing of before issue 24: one ``.data`` for every save, never read back
  (``COPIES = 1``, no renewal, no read-back);
* **trusted**: ``share_frozen="trusted"``: the same, but frozen parameters are taken on torch's version counters
  without the hash (see ``lightning_ort_ckpt._sharing``);
* **whole**: ``OrtCheckpoint(share_frozen=False)``: every save writes every byte (one file while it fits);
* **lightning**: Lightning's own ``ModelCheckpoint`` with its default ``TorchCheckpointIO`` (``torch.save``; no fsync,
  so its times are not durable ones).

Per save, the checkpoint plugin's ``save_checkpoint`` call is timed (translation, the write, fsync and the atomic
commit) and the bytes the process wrote during it are read from ``/proc/self/io`` (``wchar``). After the run the
directory's disk use is summed over distinct inodes (what ``du`` reports: a hard-linked file counts once).

The **baseline** is the same writer saving only the trainable parameters and their AdamW state (an ORT checkpoint of
that part alone), written right after each sharing save in the same run (so both meet the same disk and cache), then
deleted. At the end the writer alone is timed, alternating, on a synthetic state of the same sizes: a linked save that
hashes the frozen tensors again (the default), one that trusts them (``"trusted"``), and the trainable part
alone. Targets: the average of the second and later sharing saves is at most 1.5x the baseline's (issue 24: the
fresh copies and read-backs included; run enough saves that they recur: ``--saves 24``), and the k files kept use at
most two copies of the frozen part plus k times the rest (the largest main file), each rounded up to a 4 KiB block.

Last, the costs of issue 32 (``healing``): a full load of a checkpoint whole, with one frozen tensor damaged in its
``.data`` (read from the other copy), with its ``.data`` truncated (every frozen tensor from the other copy), and the
``repair`` that makes it whole again (docs/performance.md, "Reads that heal and the repair").
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from dataclasses import replace
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import TorchCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt._sharing import _limits
from lightning_ort_ckpt.format import (CheckpointContents, OptimizerGroup, load_checkpoint, open_checkpoint,
                                       save_checkpoint)
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt.format._shared_data import SharedFrozen, repair

WIDTH = 1024
KINDS = ("sharing", "one copy (old)", "trusted", "whole", "lightning")


class FineTune(pl.LightningModule):
    """A frozen backbone (embedding, two linear layers, BatchNorm) and a trainable head of ~5% of its size."""

    def __init__(self, frozen_m: float) -> None:
        super().__init__()
        vocab = max(1, int(frozen_m * 1e6 - 2 * (WIDTH * WIDTH + WIDTH)) // WIDTH)
        self.embed = nn.Embedding(vocab, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
        for module in (self.embed, self.body):
            module.requires_grad_(False)
        self.norm = nn.BatchNorm1d(WIDTH, affine=False)
        self.head = nn.Linear(WIDTH, max(1, int(frozen_m * 1e6 * 0.05) // WIDTH))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.embed(tokens).mean(1))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        self.log("score", float(self.global_step))
        return nn.functional.cross_entropy(self(tokens), labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.head.parameters(), lr=1e-3)


def written() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


class Timing:
    """Wraps a CheckpointIO's ``save_checkpoint``: seconds and bytes written per call; with ``baseline``, also times
    that (the trainable part alone) right after each save, so that both see the same state of the disk and cache."""

    def __init__(self, io: Any, baseline: Any = None) -> None:
        self.saves: list[tuple[float, int]] = []
        self.baselines: list[float] = []
        original = io.save_checkpoint

        def timed(*args: Any, **kwargs: Any) -> None:
            atomic.wait_for_cleanup()  # deletions of rotated files are not part of a save
            b0, t0 = written(), time.perf_counter()
            original(*args, **kwargs)
            self.saves.append((time.perf_counter() - t0, written() - b0))
            if baseline is not None:
                self.baselines.append(baseline())

        io.save_checkpoint = timed


def disk_use(directory: str) -> int:
    """Bytes allocated under ``directory``, each inode once (as ``du``)."""
    seen, total = set(), 0
    for root, _, files in os.walk(directory):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def run(kind: str, directory: str, args: argparse.Namespace, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    model = FineTune(args.frozen_m)
    model.load_state_dict(state)
    every = dict(dirpath=directory, monitor="score", mode="max", save_top_k=3, save_last=True,
                 every_n_train_steps=args.every, save_on_train_epoch_end=False)
    if kind == "lightning":
        io: Any = TorchCheckpointIO()
        callback: Any = ModelCheckpoint(**every)
    else:
        io = OrtCheckpointIO(share_frozen={"sharing": True, "one copy (old)": True, "trusted": "trusted",
                                           "whole": False}[kind])
        callback = OrtCheckpoint(**every)
    knobs = (_limits.COPIES, _limits.LINKS_PER_COPY, _limits.VERIFY_EVERY)
    if kind == "one copy (old)":  # the sharing of before issue 24
        _limits.COPIES, _limits.LINKS_PER_COPY, _limits.VERIFY_EVERY = 1, 1 << 30, 1 << 30
    trainers: list[pl.Trainer] = []
    timing = Timing(io, (lambda: trainable_alone(model, trainers[0], directory)) if kind == "sharing" else None)
    g = torch.Generator().manual_seed(0)
    steps = args.every * args.saves
    data = TensorDataset(torch.randint(0, model.embed.num_embeddings, (steps * 8, 16), generator=g),
                         torch.randint(0, model.head.out_features, (steps * 8,), generator=g))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback], plugins=[io], max_steps=steps)
    trainers.append(trainer)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, DataLoader(data, batch_size=8))
    finally:
        _limits.COPIES, _limits.LINKS_PER_COPY, _limits.VERIFY_EVERY = knobs
    atomic.wait_for_cleanup()
    files = sorted(f for f in os.listdir(directory) if f.endswith(".ckpt"))
    main = max(os.path.getsize(os.path.join(directory, f)) for f in files)
    return {"saves": timing.saves, "baselines": timing.baselines, "disk": disk_use(directory), "files": len(files),
            "largest_main": main}


def trainable_alone(model: FineTune, trainer: pl.Trainer, directory: str) -> float:
    """Seconds to write the trainable part and its AdamW state alone (zeros before the first step), with the same
    writer, to a file deleted again."""
    opt = trainer.optimizers[0]
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    states = {n: {m: opt.state[p].get(k, torch.zeros_like(p)) for m, k in (("momentum0", "exp_avg"),
                                                                          ("momentum1", "exp_avg_sq"))}
              for n, p in params.items()}
    ck = CheckpointContents(trainable=params, optimizer_groups={"group0": OptimizerGroup(trainer.global_step, 1e-3, states)})
    path = os.path.join(directory, "trainable-only.ort")
    atomic.wait_for_cleanup()
    t0 = time.perf_counter()
    save_checkpoint(ck, path)
    elapsed = time.perf_counter() - t0
    atomic.remove(path)
    atomic.wait_for_cleanup()
    return elapsed


def format_level(frozen_m: float, directory: str, reps: int = 5) -> dict[str, list[float]]:
    """The writer alone, alternating: a linked save hashing the frozen tensors again (the default), a linked save
    trusting them (``"trusted"``), and the trainable part alone; seconds per save."""
    g = torch.Generator().manual_seed(0)
    chunk = 25_000_000
    frozen = {f"backbone.{i}": torch.randn(chunk, generator=g) for i in range(max(1, int(frozen_m * 1e6) // chunk))}
    n = int(frozen_m * 1e6 * 0.05)
    head = torch.randn(n, generator=g)
    group = OptimizerGroup(1, 1e-3, {"head": {"momentum0": torch.randn(n, generator=g), "momentum1": torch.rand(n)}})
    whole = CheckpointContents(trainable={"head": head}, frozen=frozen, optimizer_groups={"group0": group})
    alone = CheckpointContents(trainable={"head": head}, optimizer_groups={"group0": group})
    first_path = os.path.join(directory, "first.ckpt")
    first = save_checkpoint(whole, first_path, shared=SharedFrozen.fresh(frozen))
    assert first is not None
    linked = SharedFrozen(dict(first.offsets), first_path + ".data", first.identity, dict(first.digests))
    trusting = replace(linked, trusted=frozenset(frozen))
    kinds = {"linked, hashed again": (whole, linked), "linked, trusted": (whole, trusting),
             "trainable part alone": (alone, None)}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for i in range(reps):
        for kind, (ck, spec) in kinds.items():
            path = os.path.join(directory, f"{i}.ckpt")
            atomic.wait_for_cleanup()
            t0 = time.perf_counter()
            save_checkpoint(ck, path, shared=spec)
            times[kind].append(time.perf_counter() - t0)
            atomic.remove(path)
    atomic.remove(first_path)
    atomic.wait_for_cleanup()
    return times


def healing(frozen_m: float, directory: str, reps: int = 3) -> dict[str, list[float]]:
    """Issue 32: two independent copies of a frozen part of ``frozen_m`` million float32 values (two checkpoints
    written fresh, as the first save and the second copy are); seconds per full load of one of them whole, with one
    tensor damaged in its ``.data`` (a flipped byte: that tensor read from the other copy), with its ``.data``
    truncated to 0 (every frozen tensor read from the other copy), and for the repair of the truncated one (a fresh
    copy written from the other's bytes, durable, read back, relinked)."""
    g = torch.Generator().manual_seed(0)
    chunk = 25_000_000
    frozen = {f"backbone.{i}": torch.randn(chunk, generator=g) for i in range(max(1, int(frozen_m * 1e6) // chunk))}
    ck = CheckpointContents(frozen=frozen)
    a, b = os.path.join(directory, "a.ckpt"), os.path.join(directory, "b.ckpt")
    for path in (a, b):
        save_checkpoint(ck, path, shared=SharedFrozen.fresh(frozen))
    times: dict[str, list[float]] = {"full load, whole": [], "full load, one tensor healed": [],
                                     "full load, every tensor healed (truncated)": [], "repair (truncated)": []}
    with open_checkpoint(a) as r:
        first = min(r.frozen.values(), key=lambda i: i.offset)
    for _ in range(reps):
        for kind in times:
            data = a + ".data"
            if kind == "full load, one tensor healed":
                os.chmod(data, 0o644)
                with open(data, "r+b") as f:
                    f.seek(first.offset + first.nbytes // 2)
                    byte = f.read(1)
                    f.seek(first.offset + first.nbytes // 2)
                    f.write(bytes([byte[0] ^ 0x40]))
            elif kind.endswith("(truncated)") and kind.startswith("full"):
                os.truncate(data, 0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                if kind.startswith("repair"):
                    assert repair([a])[0].checkpoints == [a]
                else:
                    load_checkpoint(a)
                times[kind].append(time.perf_counter() - t0)
            if kind == "full load, one tensor healed":
                repair([a])
    for path in (a, b):
        atomic.remove(path)
    atomic.wait_for_cleanup()
    return times


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frozen-m", type=float, default=251, help="frozen parameters, millions (float32)")
    parser.add_argument("--saves", type=int, default=6, help="scheduled saves (each also saves last.ckpt)")
    parser.add_argument("--every", type=int, default=2, help="steps between saves")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--runs", nargs="+", choices=KINDS, default=list(KINDS),
                        help="which runs (sharing, with its baseline, always runs)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = FineTune(args.frozen_m)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    frozen = sum(t.numel() * t.element_size() for n, t in state.items() if not n.startswith("head."))
    trainable = sum(p.numel() for p in model.head.parameters())
    print(f"model: {sum(t.numel() for t in state.values()) / 1e6:,.1f}M values; frozen part {mb(frozen)}, "
          f"trainable head {trainable / 1e6:,.1f}M parameters ({trainable * 4 / frozen:.1%} of the frozen bytes); "
          f"AdamW; a save every {args.every} steps, top-3 and save_last, {args.saves} scheduled saves")
    del model
    root = tempfile.mkdtemp(prefix="frozen_sharing_", dir=args.dir)
    results = {}
    try:
        for kind in dict.fromkeys(["sharing", *args.runs]):
            directory = os.path.join(root, kind)
            results[kind] = run(kind, directory, args, state)
            shutil.rmtree(directory)
            atomic.wait_for_cleanup()
        del state
        writer_only = format_level(args.frozen_m, root)
        heals = healing(args.frozen_m, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n| run | saves | first save | later saves: time (mean; median, max) | later saves: bytes written "
          f"(mean) | disk used by the {results['sharing']['files']} files kept |")
    print("|---|---|---|---|---|---|")
    for kind, r in results.items():
        first, later = r["saves"][0], r["saves"][1:]
        times = [t for t, _ in later]
        print(f"| {kind} | {len(r['saves'])} | {first[0]:.2f} s, {mb(first[1])} | {statistics.mean(times):.3f} s; "
              f"{statistics.median(times):.3f} s, {max(times):.2f} s | {mb(statistics.mean(b for _, b in later))} "
              f"| {mb(r['disk'])} |")
    s = results["sharing"]
    later = [t for t, _ in s["saves"][1:]]
    ratios = [t / b for (t, _), b in zip(s["saves"][1:], s["baselines"][1:])]
    base = statistics.mean(s["baselines"][1:])
    old = [t for t, _ in results["one copy (old)"]["saves"][1:]] if "one copy (old)" in results else [float("nan")]
    print(f"\nbaseline: the trainable part and its AdamW state alone ({mb(trainable * 4 * 3)} of tensors), same "
          f"writer, written right after each sharing save: mean {base:.3f} s; sharing save / baseline, save by "
          f"save: {', '.join(f'{r:.2f}' for r in ratios)}")
    limit = 1.5 * base
    block = 4096  # du counts allocated blocks: each file rounds up to one
    budget = 2 * (frozen + block) + s["files"] * (s["largest_main"] + block)
    verdict = [
        (f"second and later sharing saves, on average, <= 1.5x the baseline's ({limit:.3f} s): mean "
         f"{statistics.mean(later):.3f} s (one copy, as before issue 24: {statistics.mean(old):.3f} s)",
         statistics.mean(later) <= limit),
        (f"  ... save by save, against the baseline written right after it: median ratio "
         f"{statistics.median(ratios):.2f}, max {max(ratios):.2f} (a save writing a fresh copy)", True),
        (f"{s['files']} files use <= two frozen copies + {s['files']} x the largest main file ({mb(budget)}): "
         f"{mb(s['disk'])}", s["disk"] <= budget),
    ]
    print("\nthe writer alone, alternating (seconds per save, median of 5: "
          + "; ".join(f"{kind}: {statistics.median(t):.2f} s" for kind, t in writer_only.items()) + ")")
    print("\nhealing (issue 32), median of 3, seconds: "
          + "; ".join(f"{kind}: {statistics.median(t):.3f} s" for kind, t in heals.items()))
    print("\ntargets:")
    for text, ok in verdict:
        print(f"  {'met' if ok else 'NOT MET'}: {text}")


if __name__ == "__main__":
    main()
