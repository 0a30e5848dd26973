"""Multi-process runs the tests start themselves: a free port on 127.0.0.1, and a training script launched the way
users launch one (``python train.py``; Lightning's launcher starts the other ranks), with a bounded timeout."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


DDP_NET = r'''
class Net(pl.LightningModule):  # a tiny regression model: 8 -> 16 -> 1, AdamW
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.l2(torch.tanh(self.l1(batch[0]))), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)
'''
"""The module of the DDP child scripts, as script text (it needs ``pl``, ``torch`` and ``nn`` imported)."""

SHARDED_NET = r'''
class ShardedNet(pl.LightningModule):  # 8 -> 16 -> 1, each layer and the whole sharded with FSDP2, AdamW
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for m in (self.l1, self.l2):
            fully_shard(m, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.l2(torch.tanh(self.l1(batch[0]))), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)
'''
"""The module of the ModelParallel child scripts, as script text (it needs ``pl``, ``torch`` and ``nn`` imported):
a regression step and AdamW, which a script may override."""

NOISY = r'''
class Noisy:  # put before DDP_NET's Net or SHARDED_NET's ShardedNet: each rank draws random numbers of its own
    def training_step(self, batch, batch_idx):
        x = batch[0] + 0.05 * torch.randn_like(batch[0])  # per-rank random numbers decide the run
        return nn.functional.mse_loss(self.l2(torch.tanh(self.l1(x))), batch[1])

    def on_fit_start(self):
        torch.manual_seed(1000 + self.global_rank)
'''
"""A mixin of the child scripts, as script text: a run that resumes bit for bit only if each rank restores its own
random states."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_script(script: Path, args: list[str], what: str, timeout: float, **extra_env: str) -> None:
    """Run ``script`` with ``args`` in its folder on a fresh loopback port; fail the test, with the run's output,
    if it does not end within ``timeout`` seconds or exits non-zero."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONWARNINGS": "ignore",
           **extra_env}
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "PL_GLOBAL_SEED"):
        env.pop(name, None)  # the launcher decides these
    try:
        proc = subprocess.run([sys.executable, str(script), *args], env=env, cwd=str(script.parent),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what} hung:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"


def start_ranks(script: Path, args: list[str], world_size: int, **extra_env: str) -> list[subprocess.Popen[str]]:
    """Start ``script`` once per rank, as a launcher starts a job's ranks (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``
    and torch.distributed's ``env://`` rendezvous on a fresh loopback port: Lightning starts no process of its own,
    the package of this checkout importable), each rank's output (stdout and stderr) on its ``stdout``, as text."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0",
           "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
           **extra_env}
    for name in ("GLOBAL_RANK", "PL_GLOBAL_SEED"):
        env.pop(name, None)  # the launcher decides these
    return [subprocess.Popen([sys.executable, str(script), *args], env={**env, "RANK": str(rank),
                                                                         "LOCAL_RANK": str(rank)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace") for rank in range(world_size)]


def launch_ranks(script: Path, args: list[str], world_size: int, timeout: float, **extra_env: str) -> None:
    """Run ``script`` once per rank (``start_ranks``); fail the test with a rank's output if a rank does not end
    within ``timeout`` seconds or exits non-zero."""
    procs = start_ranks(script, args, world_size, **extra_env)
    logs: list[str] = []
    with _ending(procs, f"{script.name} {' '.join(args)}: a rank", timeout):
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]


def launch_nodes(script: Path, args: list[str], folders: list[Path], what: str, timeout: float, per_node: int = 1,
                 **extra_env: str) -> None:
    """Run ``script`` on each simulated node, ``per_node`` processes a node (``Trainer(devices=per_node,
    num_nodes=len(folders))``), as a cluster launcher starts them: ``NODE_RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``
    in the environment, which Lightning reads, so that it starts no process itself; node ``n``'s processes run in
    ``folders[n]``, their working directory: a path through ``/proc/self/cwd`` is one path on every node and a
    folder of each node's own, shared by its processes, as a node-local disk is. Fails the test with a process's
    output if one does not end within ``timeout`` seconds or exits non-zero."""
    port = free_port()
    procs: list[tuple[subprocess.Popen[bytes], Path, str]] = []
    for node, folder in enumerate(folders):
        folder.mkdir(parents=True, exist_ok=True)
        for local in range(per_node):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(node),
                   "LOCAL_RANK": str(local), "WORLD_SIZE": str(len(folders) * per_node), "OMP_NUM_THREADS": "1",
                   "PYTHONWARNINGS": "ignore",
                   "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
                   **extra_env}
            for name in ("GLOBAL_RANK", "RANK", "PL_GLOBAL_SEED"):
                env.pop(name, None)
            log = folder.parent / f"{folder.name}.{local}.log"  # a file: no pipe fills while a process waits
            with open(log, "w") as out:
                procs.append((subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=str(folder),
                                               stdout=out, stderr=subprocess.STDOUT), log,
                              f"node {node}, local rank {local}"))
    with _ending([p for p, _, _ in procs], f"{what}: a process", timeout):
        for p, _, _ in procs:
            p.wait(timeout=timeout)
    for p, log, who in procs:
        assert p.returncode == 0, f"{what}, {who}:\n{log.read_text(errors='replace')[-6000:]}"


@contextlib.contextmanager
def _ending(procs: list[subprocess.Popen[Any]], who: str, timeout: float) -> Iterator[None]:
    """The wait for ``procs`` inside: a timeout fails the test naming ``who``; none outlives it."""
    try:
        yield
    except subprocess.TimeoutExpired:
        pytest.fail(f"{who} did not end within {timeout:.0f} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
