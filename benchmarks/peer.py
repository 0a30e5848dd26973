"""Peer copies of the fast tier (``LocalTier(peer=True)``, issue 39 point 4): what they cost training.

    python benchmarks/peer.py                                  # 2 CPU ranks (DDP, gloo), a 5M-parameter model
    python benchmarks/peer.py --params-m 25 --steps 30 --rounds 5
    python benchmarks/peer.py --strategy sharded               # ModelParallel (FSDP2): each rank's shard files

Launched as users launch a run (``python peer.py``: Lightning's launcher starts rank 1). Two ranks train a
``--params-m`` million-parameter MLP with AdamW for ``--steps`` steps, each with a fast folder of its own (in
``/dev/shm`` where it exists: two nodes' local disks on one machine), three ways in the same processes, in turn: no
checkpointing, the fast tier every step with ``async_save=True``, and the same with ``peer=True`` (each save also sent
to the other rank over a gloo group and committed there, checksums verified). The time from the first step after 2
warm-up steps to the end of ``fit`` (which waits for every queued save and exchange) is taken on rank 0; a first
round is dropped, then ``--rounds`` rounds run the three in turn and each one's median is reported, with the peer
run's ratio to the fast tier without it (the cost of the copies) and to no checkpointing.

``--strategy sharded``: ``ModelParallelStrategy`` (FSDP2, the MLP sharded over the two ranks), where every rank
writes its shard file of each fast-tier save into its own node's folder and sends it to the other rank (rank 0 the
metadata too). Each rank then runs in a working directory of its own and the fast tier's one path is
``/proc/self/cwd/...``: one path on both ranks, each one's own folder, as node-local disks are.
"""

from __future__ import annotations

import argparse
import os
import shutil
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

WARM_UP = 2


class Mlp(pl.LightningModule):
    def __init__(self, params_m: float, sharded: bool = False) -> None:
        super().__init__()
        self.sharded = sharded
        width = max(8, int((params_m * 1e6 / 8) ** 0.5))  # blocks of Linear(d, 4d), Linear(4d, d): 8 d^2 each
        self.net = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
        self.width = width

    def configure_model(self) -> None:
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh
            assert mesh is not None  # (ModelParallelStrategy sets it before configure_model)
            for layer in (self.net[0], self.net[2], self):
                fully_shard(layer, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Clock(pl.Callback):
    def __init__(self) -> None:
        self.start = 0.0

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == WARM_UP:
            self.start = time.perf_counter()


def timed(how: str, params_m: float, steps: int, folder: str, sharded: bool) -> float:
    """Seconds from the first step after the warm-up to the end of ``fit`` on this rank."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    clock = Clock()
    callbacks: list[Any] = [clock]
    if how != "none":
        fast = f"/proc/self/cwd/{how}" if sharded else os.path.join(folder, f"{how}-{rank}")
        callbacks.append(OrtCheckpoint(os.path.join(folder, f"persistent-{how}"), every_n_train_steps=10 ** 6,
                                       async_save=True, local=LocalTier(fast, every_n_train_steps=1, keep=2,
                                                                        peer=how == "peer")))
    model = Mlp(params_m, sharded)
    data = TensorDataset(torch.randn(4 * steps, model.width, generator=torch.Generator().manual_seed(0)))
    strategy: Any = "ddp"
    if sharded:
        from pytorch_lightning.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                         callbacks=callbacks, enable_checkpointing=how != "none", enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, DataLoader(data, batch_size=2))
    elapsed = time.perf_counter() - clock.start
    trainer.strategy.barrier()
    for name in os.listdir(os.getcwd() if sharded else folder):  # (each rank its own node's folder)
        if sharded or rank == 0:
            shutil.rmtree(os.path.join(os.getcwd() if sharded else folder, name), ignore_errors=True)
    trainer.strategy.barrier()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-m", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--strategy", choices=("ddp", "sharded"), default="ddp")
    args = parser.parse_args()
    sharded = args.strategy == "sharded"
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if "PEER_BENCH_DIR" not in os.environ:  # (rank 1, started by Lightning, inherits rank 0's: it makes none)
        os.environ["PEER_BENCH_DIR"] = tempfile.mkdtemp(prefix="peer-bench-", dir=base)
    folder = os.environ["PEER_BENCH_DIR"]
    if sharded:  # each rank's own "node": its working directory
        node = os.path.join(folder, f"node{os.environ.get('LOCAL_RANK', '0')}")
        os.makedirs(node, exist_ok=True)
        sys.argv[0] = os.path.abspath(sys.argv[0])  # Lightning starts rank 1 with this script's path
        os.chdir(node)
    kinds = ("none", "fast", "peer")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for round_ in range(args.rounds + 1):
        for how in kinds:
            seconds = timed(how, args.params_m, args.steps, folder, sharded)
            if round_:
                times[how].append(seconds)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        median = {k: statistics.median(v) for k, v in times.items()}
        rounds = ", ".join(f"{t:.2f}" for t in times["peer"])
        print(f"{args.params_m:g}M parameters, {args.steps} steps, 2 ranks ({args.strategy}, gloo), fast tier every step, "
              f"async_save=True; median of {args.rounds} rounds (each: {rounds} s with peer copies)")
        for how in kinds:
            print(f"  {how:>5}: {median[how]:.2f} s")
        print(f"  peer / fast tier alone: {median['peer'] / median['fast']:.3f}x; "
              f"peer / no checkpointing: {median['peer'] / median['none']:.3f}x")
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
