"""Packaging and set-up: what the sdist and wheel carry and declare, ``ort-ckpt --version``, and a set-up script that
does not reinstall a complete ``.venv`` (so it works offline)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning_ort_ckpt

ROOT = Path(__file__).resolve().parents[2]


def test_cli_version() -> None:
    result = subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", "--version"], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == f"ort-ckpt {lightning_ort_ckpt.__version__}"


def test_sdist_and_wheel_carry_what_users_and_tests_need(tmp_path: Path) -> None:
    """Built from a copy of the checkout with setuptools' own backend (what pip and `python -m build` call)."""
    import tarfile
    import zipfile

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "out",
                                                             "*-out", "build", "dist"))
    build = (f"from setuptools import build_meta; build_meta.build_sdist({str(tmp_path / 'dist')!r}); "
             f"build_meta.build_wheel({str(tmp_path / 'dist')!r})")
    result = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, cwd=src)
    assert result.returncode == 0, result.stderr[-3000:]
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in ("LICENSE", "tests/checkpointing/test_integration.py", "tests/helpers/ort_reference.py",
                   "examples/demo_model.py", "schema/ort_training_checkpoint.fbs", "lightning_ort_ckpt/py.typed",
                   "scripts/env.sh"):
        assert needed in names, f"the sdist lacks {needed}"
    with zipfile.ZipFile(wheel) as whl:
        assert "lightning_ort_ckpt/py.typed" in whl.namelist()
        info = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = whl.read(info).decode()
        entry_points = whl.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert f"Version: {lightning_ort_ckpt.__version__}" in metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    assert [r for r in requires if r.startswith("Requires-Dist: onnx")] == [
        'Requires-Dist: onnxruntime-training==1.19.2; (python_version == "3.11" and platform_system == "Linux" and '
        'platform_machine == "x86_64") and extra == "ort"', 'Requires-Dist: onnx>=1.15; extra == "ort"',
        'Requires-Dist: onnxruntime>=1.20; extra == "deploy"', 'Requires-Dist: onnx>=1.15; extra == "deploy"']
    assert "Requires-Dist: pytorch-lightning>=2.5.3" in requires
    assert "ort-ckpt = lightning_ort_ckpt._command._cli:main" in entry_points
    assert "callbacks_factory" not in entry_points  # installing the package adds nothing to other Trainers


def test_env_script_installs_only_when_pyproject_or_pins_change(tmp_path: Path) -> None:
    """A complete .venv works offline: scripts/env.sh calls pip only when the install it records is out of date."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "env.sh", tmp_path / "scripts" / "env.sh")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/../pip-calls"\n')
    fake.chmod(0o755)

    def source(pins: str = "") -> int:
        subprocess.run(["bash", "-c", "set -euo pipefail; source scripts/env.sh"], cwd=tmp_path, check=True,
                       env={**os.environ, "PINS": pins})
        calls = tmp_path / ".venv" / "pip-calls"
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    assert source() == 1  # first time: install
    assert source() == 1  # complete: no pip (works offline)
    assert source("pytorch-lightning==2.5.3") == 2  # other pins: install
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\nversion = '2'\n")
    assert source("pytorch-lightning==2.5.3") == 3  # a changed pyproject.toml: install
    assert source("pytorch-lightning==2.5.3") == 3


def test_env_script_says_each_step_and_its_time(tmp_path: Path) -> None:
    """No minute of silence: a fresh install prints a line per step (start, then end with its time) and pip's own
    per-package lines (pip runs without --quiet); an up-to-date .venv says so in one line."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "env.sh", tmp_path / "scripts" / "env.sh")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\ncase "$*" in *--quiet*) exit 3;; esac\necho "Collecting torch==2.13.0"\n')
    fake.chmod(0o755)

    def source() -> str:
        return subprocess.run(["bash", "-c", "set -euo pipefail; source scripts/env.sh"], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout

    first = source().splitlines()
    assert first[0].startswith("[env] installing torch 2.13.0") and first[0].endswith("...")
    assert first[1] == "Collecting torch==2.13.0"
    assert first[2].startswith("[env] installing torch 2.13.0") and first[2].endswith(" s")
    assert source().strip() == "[env] .venv is up to date with pyproject.toml: nothing to install"
