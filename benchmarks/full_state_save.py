"""Full-state saves under ``ModelParallelStrategy(save_distributed_checkpoint=False)``: ``OrtCheckpoint`` against
Lightning's ``ModelCheckpoint`` (``TorchCheckpointIO``, ``torch.save``), the same model, in the same run.

Two CPU processes (gloo on 127.0.0.1, started as Lightning starts them) train a stack of ``--mb`` MiB of
``nn.Linear`` layers, each and the whole module ``fully_shard``-ed (FSDP2), with AdamW; the checkpoint callback saves
after every step (``--saves`` steps, the latest file kept). Under this strategy Lightning gathers the full module and
optimizer state on rank 0 (``cpu_offload=True``) and rank 0 writes it through the ``CheckpointIO``. Per save, on
rank 0: the time of ``trainer.save_checkpoint`` (gather and write, between the other ranks' collectives), the time
of the write alone (the ``CheckpointIO``'s ``save_checkpoint``), the size of the gathered state (every tensor of the
checkpoint dict), and the peak memory of the save above the memory before it (``VmHWM`` after the save minus
``VmRSS`` before it, the high-water mark reset through ``/proc/self/clear_refs`` just before; glibc is told to
map every allocation of 64 KiB or more on its own, so freed tensors leave the RSS at once and the memory before a
save is what is live). Each variant runs in
fresh processes, ``--rounds`` times, alternating which goes first; the figures are the medians over all saves but
the first of each run (the first pays one-off costs: page faults of fresh memory, imports) and the first-save
figures beside them. ``torch.save`` does not fsync; ours commits durably (fsync, rename). Files go to ``--dir``
(default: a temporary folder).

Run: ``python benchmarks/full_state_save.py --mb 128`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

VARIANTS = ("ours", "lightning")


def _memory_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _tensor_bytes(tree: Any) -> int:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _fit(variant: str, mb: int, saves: int, directory: str, out: str) -> None:
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.strategies import ModelParallelStrategy
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ort_ckpt import OrtCheckpoint

    width = 2048
    layers = max(1, round(mb * (1 << 20) / (4 * width * (width + 1))))

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x = batch[0]
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x.square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    pl.seed_everything(0)
    dirpath = os.path.join(directory, variant)
    callback = (OrtCheckpoint(dirpath, every_n_train_steps=1, save_top_k=1) if variant == "ours"
                else ModelCheckpoint(dirpath, every_n_train_steps=1, save_top_k=1))
    trainer = pl.Trainer(max_steps=saves, accelerator="cpu", devices=2, logger=False, callbacks=[callback],
                         strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                        save_distributed_checkpoint=False),
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    records: list[dict[str, Any]] = []
    write: dict[str, float] = {}

    def reset_peak() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current RSS

    def timed_io(io: Any) -> None:
        if getattr(io, "_bench_timed", False):
            return
        original = io.save_checkpoint

        def save_checkpoint(checkpoint: dict[str, Any], *args: Any, **kwargs: Any) -> None:
            write.update(gathered=_tensor_bytes(checkpoint), gather_peak_kb=_memory_kb("VmHWM"),
                         before_kb=_memory_kb("VmRSS"))
            reset_peak()
            start = time.perf_counter()
            original(checkpoint, *args, **kwargs)
            write.update(s=time.perf_counter() - start, peak_kb=_memory_kb("VmHWM"))

        io.save_checkpoint = save_checkpoint
        io._bench_timed = True

    save = trainer.save_checkpoint

    def timed_save(*args: Any, **kwargs: Any) -> None:
        timed_io(trainer.strategy.checkpoint_io)
        write.clear()
        before = _memory_kb("VmRSS")
        reset_peak()
        start = time.perf_counter()
        save(*args, **kwargs)
        seconds = time.perf_counter() - start
        peak = max(_memory_kb("VmHWM"), write.get("gather_peak_kb", 0))
        records.append({"save_s": seconds, "write_s": write.get("s"), "gathered_mb": write.get("gathered", 0) / 2**20,
                        "peak_extra_mb": (peak - before) / 1024,
                        "write_extra_mb": (write.get("peak_kb", 0) - write.get("before_kb", 0)) / 1024})

    trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
    x = torch.randn(8 * saves, width, generator=torch.Generator().manual_seed(0))
    trainer.fit(Stack(), DataLoader(TensorDataset(x), batch_size=4))
    with open(f"{out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump({"variant": variant, "layers": layers, "saves": records}, f)


def _launch(variant: str, mb: int, saves: int, directory: str, out: str) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONWARNINGS": "ignore",
           "MALLOC_MMAP_THRESHOLD_": str(1 << 16),  # freed tensors go back to the system: RSS is what is live
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "PL_GLOBAL_SEED"):
        env.pop(name, None)  # Lightning's launcher decides these
    subprocess.run([sys.executable, os.path.abspath(__file__), "--fit", variant, "--mb", str(mb), "--saves",
                    str(saves), "--dir", directory, "--out", out], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=600)
    with open(f"{out}.rank0.json") as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=128, help="MiB of float32 parameters (the gathered state is "
                                                            "about 3x: parameters and AdamW's two moments)")
    parser.add_argument("--saves", type=int, default=3, help="saves (training steps) per run")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant, alternating the order")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--fit", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit:
        _fit(args.fit, args.mb, args.saves, args.dir, args.out)
        return
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for r in range(args.rounds):
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                runs[variant].append(_launch(variant, args.mb, args.saves, directory,
                                             os.path.join(directory, f"{variant}{r}")))
    layers = runs["ours"][0]["layers"]
    print(f"{layers} layers of nn.Linear(2048, 2048), {args.saves} saves per run, {args.rounds} runs each")
    print("variant    gathered  save s (first)   write s (first)   rank-0 peak MiB above: pre-save (first), "
          "pre-write (first)")
    for variant, results in runs.items():
        first = [run["saves"][0] for run in results]
        rest = [s for run in results for s in run["saves"][1:]] or first

        def med(key: str, rows: list[dict[str, Any]]) -> float:
            return statistics.median(row[key] for row in rows)

        print(f"{variant:10} {med('gathered_mb', rest):7.0f}M  {med('save_s', rest):6.3f} ({med('save_s', first):.3f})"
              f"   {med('write_s', rest):6.3f} ({med('write_s', first):.3f})"
              f"   {round(med('peak_extra_mb', rest)):5d} ({round(med('peak_extra_mb', first))})"
              f"   {round(med('write_extra_mb', rest)):5d} ({round(med('write_extra_mb', first))})")


if __name__ == "__main__":
    main()
