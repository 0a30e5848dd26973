"""Multi-process runs the tests start themselves: a free port on 127.0.0.1, and a training script launched the way
users launch one (``python train.py``; Lightning's launcher starts the other ranks), with a bounded timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


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
