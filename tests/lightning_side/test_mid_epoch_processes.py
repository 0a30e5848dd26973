"""Exact resume inside an epoch with real processes (issue 38): world size 2 (gloo on loopback) under DDP and a
sharded strategy, and a training process killed with SIGKILL at random steps, resumed with ``ckpt_path="last"``.

A standalone script (written to ``tmp_path``) trains on a dataset of indices that records, per rank, the indices of
every batch it trains. Under ``strategy="ddp"`` and ``ModelParallelStrategy`` (a sharded checkpoint folder; both
shuffle through the ``DistributedSampler`` Lightning injects) one launch runs, per strategy, the uninterrupted run
and the first part of an interrupted one (stopped at a step inside the second epoch, saved there); a second launch,
in fresh processes, resumes it. Each rank's batches after the resume must be the uninterrupted run's. The SIGKILL
runs are one process each, killed from inside ``training_step`` (no exception handler runs); the resumed run finds
the newest checkpoint itself.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import forkserver
from helpers.launching import launch_script

SCRIPT = r'''
import json, os, random, signal, sys
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from pytorch_lightning.strategies import ModelParallelStrategy
from lightning_ort_ckpt import OrtCheckpoint, OrtCheckpointIO


class Indexed(Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        return torch.tensor([float(i)])


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        rank = int(os.environ.get("LOCAL_RANK", 0))
        return (torch.tensor([float(i)]) for i in range(rank, 48, 2))


class ShuffledBatches:
    """A custom batch sampler, deterministic given Python's random state when its epoch starts, that shards by rank
    itself (with ``use_distributed_sampler=False``)."""

    def __init__(self, n, size):
        self.n, self.size = n, size

    def __iter__(self):
        order = list(range(2 * self.n))
        random.shuffle(order)
        order = order[int(os.environ.get("LOCAL_RANK", 0))::2]
        return iter([order[i:i + self.size] for i in range(0, self.n, self.size)])

    def __len__(self):
        return -(-self.n // self.size)


def make_loader(name, workers):
    from pytorch_lightning.utilities import CombinedLoader
    if name == "sequential":
        return DataLoader(Indexed(), batch_size=4, num_workers=workers)
    if name == "shuffle":
        return DataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=workers)
    if name == "drop_last":
        return DataLoader(Indexed(), batch_size=5, shuffle=True, drop_last=True)
    if name == "batch_sampler":
        return DataLoader(Indexed(), batch_sampler=ShuffledBatches(24, 4))
    if name == "several":
        return CombinedLoader([DataLoader(Indexed(), batch_size=4, shuffle=True),
                               DataLoader(torch.utils.data.Subset(Indexed(), range(36)), batch_size=4, shuffle=True)])
    if name == "iterable":
        return DataLoader(Stream(), batch_size=4)
    raise ValueError(name)


class Net(pl.LightningModule):
    def __init__(self, out, name, sharded, kill_at=None, sig=signal.SIGKILL):
        super().__init__()
        self.out, self.name, self.sharded, self.kill_at, self.sig = out, name, sharded, kill_at, sig
        self.l1, self.l2 = nn.Linear(1, 8), nn.Linear(8, 1)
        self.drop = nn.Dropout(0.3)

    def configure_model(self):
        if self.sharded:
            from torch.distributed.fsdp import fully_shard
            mesh = self.device_mesh["data_parallel"]
            for m in (self.l1, self.l2):
                fully_shard(m, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        if self.kill_at is not None and self.global_step == self.kill_at:
            os.kill(os.getpid(), self.sig)  # SIGTERM: Lightning ends the step, then saves on the exception
        parts = batch if isinstance(batch, list) else [batch]
        with open(os.path.join(self.out, f"{self.name}.seen{self.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps([self.global_step, [int(v) for p in parts for v in p.flatten().tolist()]]) + "\n")
        return self.l2(self.drop(torch.tanh(self.l1(torch.cat(parts) / 48)))).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def fit(out, kind, name, max_steps, ckpt_path=None, every=3, kill_at=None, sig=signal.SIGKILL):
    pl.seed_everything(0)
    devices = 1 if kind == "single" else 2
    how, _, data = kind.partition("-")
    strategy = {"single": "auto", "ddp": "ddp",
                "mp": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)}[how]
    cb = OrtCheckpoint(os.path.join(out, kind, "ckpts"), every_n_train_steps=every, save_top_k=-1,
                       save_on_exception=True, checkpoint_io=OrtCheckpointIO(fast_forward_iterables=True))
    trainer = pl.Trainer(max_steps=max_steps, strategy=strategy, devices=devices, accelerator="cpu", logger=False,
                         callbacks=[cb], num_sanity_val_steps=0, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0,
                         use_distributed_sampler=data != "batch_sampler")
    loader = make_loader(data or "shuffle", 1 if kind == "single" else 0)
    trainer.fit(Net(out, f"{kind}-{name}", how == "mp", kill_at, sig), loader, ckpt_path=ckpt_path)


out, phase, kinds = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
for kind in kinds:
    if phase == "first":
        fit(out, kind, "straight", 14, every=100)
        fit(out, kind, "half", 8, every=8)  # epoch 1 (6 batches per rank and epoch) stopped and saved at step 8
    elif phase == "resume":
        fit(out, kind, "resumed", 14, ckpt_path=os.path.join(out, kind, "ckpts", "epoch=1-step=8.ckpt"), every=100)
    elif phase == "straight":
        fit(out, kind, "straight", 20, every=100)
    elif phase.startswith("kill:"):
        fit(out, kind, phase.replace(":", ""), 20, kill_at=int(phase[5:]))
    elif phase.startswith("term:"):
        fit(out, kind, phase.replace(":", ""), 20, kill_at=int(phase[5:]), sig=signal.SIGTERM)
    elif phase == "last":
        fit(out, kind, "last", 20, ckpt_path="last")
'''


def seen(tmp_path: Path, name: str, rank: int = 0) -> list[tuple[int, list[int]]]:
    lines = (tmp_path / f"{name}.seen{rank}.jsonl").read_text().splitlines()
    return [tuple(json.loads(line)) for line in lines]  # type: ignore[misc]


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mid_epoch") / "train.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture(scope="module")
def straight(script: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, list[int]]]:
    """The uninterrupted single-process run of 20 steps: the batches every interrupted one must train on."""
    out = tmp_path_factory.mktemp("straight")
    run(script, out, "straight", "single")
    return seen(out, "single-straight")


def run(script: Path, out: Path, phase: str, kinds: str, timeout: float = 300) -> None:
    launch_script(script, [str(out), phase, kinds], f"the run ({phase} {kinds})", timeout)


WORLD_SIZE_2 = ["ddp-sequential", "ddp-shuffle", "ddp-drop_last", "ddp-batch_sampler", "ddp-several",
                "ddp-iterable", "mp-shuffle"]
"""Under DDP every loader kind (the DistributedSampler Lightning injects shuffles or not as the loader did; an
IterableDataset is read and dropped with fast_forward_iterables); under ModelParallel (a sharded folder) one. No
worker processes here: a rank's second DataLoader worker was seen stuck inside ``os.fork`` (twice, in whole-suite
runs under load); workers and persistent workers resume at world size 1 (``test_mid_epoch.py``, and the SIGKILL
runs below)."""


def test_two_ranks_resume_at_their_batch_under_ddp_and_a_sharded_strategy(script: Path, tmp_path: Path) -> None:
    run(script, tmp_path, "first", ",".join(WORLD_SIZE_2), timeout=600)
    for kind in WORLD_SIZE_2:
        assert (tmp_path / kind / "ckpts" / "epoch=1-step=8.ckpt").exists()
    run(script, tmp_path, "resume", ",".join(WORLD_SIZE_2), timeout=600)
    for kind in WORLD_SIZE_2:
        for rank in (0, 1):
            straight = seen(tmp_path, f"{kind}-straight", rank)
            half = seen(tmp_path, f"{kind}-half", rank)
            resumed = seen(tmp_path, f"{kind}-resumed", rank)
            assert [s for s, _ in resumed] == list(range(8, 14)), f"{kind} rank {rank}"
            assert half + resumed == straight, f"{kind} rank {rank}: {resumed[:2]} instead of {straight[8:10]}"
        assert seen(tmp_path, f"{kind}-straight", 0)[8:] != seen(tmp_path, f"{kind}-straight", 1)[8:], kind


def _forked(script: Path, args: list[str], cwd: Path) -> tuple[int, str]:
    """``python script args...`` forked from the fork server (torch and Lightning imported once, the package fresh
    in each child): its exit status and output."""
    proc = forkserver.spawn(script=str(script), args=args, cwd=str(cwd), merge_stderr=True)
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"python {script.name} {' '.join(args)} hung (over 300 s)")
    return proc.returncode, output


def test_a_process_killed_at_random_steps_resumes_last_at_its_batch(script: Path, straight: list[Any],
                                                                    tmp_path: Path) -> None:
    """SIGKILL (no handler runs) at random steps of a 20-step run with saves every 3 steps and a worker process;
    ``fit(ckpt_path="last")`` in a fresh process (each forked from the fork server, which imported torch and
    Lightning once) trains on the uninterrupted run's batches from the newest save."""
    kills = sorted(np.random.default_rng(38).choice(np.arange(4, 20), size=3, replace=False).tolist())
    for kill in kills:
        out = tmp_path / f"kill{kill}"
        out.mkdir()
        returncode, output = _forked(script, [str(out), f"kill:{kill}", "single"], out)
        assert returncode == -signal.SIGKILL, output[-3000:]
        trained = seen(out, f"single-kill{kill}")
        assert [s for s, _ in trained] == list(range(kill))
        newest = max(int(p.stem.split("step=")[1]) for p in (out / "single" / "ckpts").glob("*.ckpt"))
        returncode, output = _forked(script, [str(out), "last", "single"], out)
        assert returncode == 0, output[-3000:]
        resumed = seen(out, "single-last")
        assert trained[:newest] + resumed == straight, f"killed at step {kill}, resumed from step {newest}"


def test_a_sigterm_save_inside_an_epoch_resumes_last_at_its_batch(script: Path, straight: list[Any],
                                                                   tmp_path: Path) -> None:
    """SIGTERM (a spot or Kubernetes preemption) at a seeded random step: Lightning finishes the step and raises,
    ``OrtCheckpoint(save_on_exception=True)`` saves the current step, and ``fit(ckpt_path="last")`` in a fresh
    process trains on the uninterrupted run's batches from there."""
    term = int(np.random.default_rng(39).integers(4, 19))
    out = tmp_path / "term"
    out.mkdir()
    _, output = _forked(script, [str(out), f"term:{term}", "single"], out)
    assert "Received SIGTERM" in output, output[-3000:]
    trained = seen(out, f"single-term{term}")
    saved = max(int(p.stem.split("step=")[1].split("-")[0]) for p in (out / "single" / "ckpts").glob("*.ckpt"))
    assert saved == term + 1 == len(trained), (saved, term, len(trained))  # the step in progress, finished and saved
    returncode, output = _forked(script, [str(out), "last", "single"], out)
    assert returncode == 0, output[-3000:]
    assert trained + seen(out, "single-last") == straight, f"SIGTERM at step {term}"
