"""Checkpoints of the crash-safety tests and their child processes (forked from ``forkserver``), which save, die
and leave what the tests inspect (tests/format/test_crash_safety.py, tests/format/test_atomic_limits.py,
tests/format/test_concurrency.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_ort_ckpt.format import CheckpointContents, OptimizerGroup
from lightning_ort_ckpt.format import _atomic as atomic

from helpers import forkserver


TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # what a child puts on sys.path
BIG_SIDE = 8192  # the big checkpoint: one 8192 x 8192 float32 tensor = 256 MiB


def small_checkpoint(seed: int) -> CheckpointContents:
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(4, 3, generator=g), torch.randn(3, generator=g)
    return CheckpointContents(
        trainable={"fc.weight": w, "fc.bias": b, "temperature": torch.tensor(float(seed))},
        frozen={"bn.num_batches_tracked": torch.tensor(seed * 1000, dtype=torch.int64),
                "bn.running_mean": torch.randn(3, generator=g)},
        optimizer_groups={"group0": OptimizerGroup(
            step=seed, initial_learning_rate=0.01,
            states={n: {"momentum0": torch.randn(t.shape, generator=g), "momentum1": torch.rand(t.shape, generator=g)}
                    for n, t in (("fc.weight", w), ("fc.bias", b))})},
        properties={"seed": seed, "loss": 1.0 / (seed + 1), "tag": f"checkpoint-{seed}"})


def big_checkpoint(seed: int) -> CheckpointContents:
    """256 MiB in one non-contiguous tensor (so it is copied out in chunks: the save takes a while)."""
    ck = small_checkpoint(seed)
    ck.trainable["big"] = torch.full((BIG_SIDE, BIG_SIDE), float(seed)).t()
    return ck


def expected(seed: int) -> CheckpointContents:
    """What a saved small_checkpoint(seed) loads as (float properties come back as float32)."""
    ck = small_checkpoint(seed)
    ck.properties["loss"] = float(torch.tensor(ck.properties["loss"], dtype=torch.float32))
    for group in ck.optimizer_groups.values():
        group.initial_learning_rate = float(torch.tensor(group.initial_learning_rate, dtype=torch.float32))
    return ck


def snapshot(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every name in ``directory`` with its inode, mtime and contents: what "changes nothing" compares."""
    out = {}
    for p in sorted(directory.iterdir()):
        st = p.lstat()
        out[p.name] = (st.st_ino, st.st_mtime_ns, p.read_bytes() if p.is_file() else b"")
    return out


def leftovers(directory: Path, pid: int | None = None) -> list[str]:
    """Temporary, journal and retired files in ``directory`` (of process ``pid`` if given)."""
    names = [n for n in os.listdir(directory) if n.endswith((".tmp", ".old", atomic.JOURNAL_SUFFIX))]
    return sorted(n for n in names if pid is None or f".{pid}." in n)


_PRELUDE = f"""
import json, os, resource, shutil, signal, sys
sys.path.insert(0, {TESTS_DIR!r})
from helpers.crash import big_checkpoint, small_checkpoint
from lightning_ort_ckpt.format import save_checkpoint
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt.format._atomic import _commit, _names
path, mode = sys.argv[1], sys.argv[2]
extra = sys.argv[3:]

def save_a_and_keep_a_copy():
    save_checkpoint(small_checkpoint(1), path, external_data=mode)
    shutil.copyfile(path, path + ".ref")
    if os.path.exists(atomic.data_path(path)):
        shutil.copyfile(atomic.data_path(path), path + ".ref.data")
"""


def child(body: str, path: Path, mode: str, *extra: str) -> forkserver.Child:
    """``python -c <prelude + body> path mode extra...``, forked from the fork server (torch imported once)."""
    return forkserver.spawn(code=_PRELUDE + textwrap.dedent(body), args=[str(path), mode, *extra],
                            cwd=str(path.parent))


def finish(proc: forkserver.Child, timeout: float = 300) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"child process hung:\n{out}\n{err}")
    return out, err


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
