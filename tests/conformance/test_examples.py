"""The examples run as users run them (the README's demo command runs quickstart.py), in a fresh process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(*args: str, cwd: Path, stderr: list[str] | None = None) -> str:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if stderr is not None:
        stderr.append(result.stderr)
    return result.stdout


def test_quickstart_and_cli_export(tmp_path):
    stderr: list[str] = []
    out = run(str(EXAMPLES / "quickstart.py"), str(tmp_path / "qs"), cwd=tmp_path, stderr=stderr)
    assert stderr == [""], stderr  # no Lightning banners, tips or deprecation warnings
    # a real interruption: the first run's process is killed before its last step, and the resume says from where
    assert "step 70: the process is killed" in out and "killed by signal SIGKILL" in out, out
    assert "resumed from checkpoints/last.ckpt at step 64, finished at step 128" in out, out
    parity = re.search(r"max abs difference (\S+) \(tolerance 1e-05\)", out)
    assert parity and float(parity.group(1)) <= 1e-5, out
    accuracy = re.search(r"accuracy (\S+) on 1000 new samples", out)
    assert accuracy and float(accuracy.group(1)) > 0.9, out
    assert re.search(r"Lightning checkpoint: epoch \d+, global step \d+, saved by Lightning", out), out
    checkpoints = sorted(p.name for p in (tmp_path / "qs" / "checkpoints").iterdir())
    assert "last.ckpt" in checkpoints and len(checkpoints) >= 3

    best = re.search(r"ort-ckpt export (\S+) --module (\S+) --output (\S+)", out)
    cli = run("-m", "lightning_ort_ckpt", "export", best.group(1), "--module", best.group(2), "--output",
              str(tmp_path / "cli.onnx"), cwd=tmp_path)
    assert re.search(r"max abs difference \S+ \(tolerance 1e-05\)", cli), cli
    session = onnxruntime.InferenceSession(str(tmp_path / "cli.onnx"), providers=["CPUExecutionProvider"])
    assert session.run(None, {"input": np.zeros((2, 16), np.float32)})[0].shape == (2, 3)


def test_on_device_roundtrip_example(tmp_path):
    out = run(str(EXAMPLES / "on_device_roundtrip.py"), str(tmp_path / "rt"), cwd=tmp_path)
    assert re.search(r"saved \S+ort_trained.ckpt: optimizer step \d+", out), out
    parity = re.search(r"max abs difference (\S+) \(tolerance 1e-05\)", out)
    assert parity and float(parity.group(1)) <= 1e-5, out
