"""The command line in a fresh interpreter (``python -m lightning_ort_ckpt``), and an environment without torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its package and its tests importable


def run_cli(*args: Any, cwd: Any = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                       os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def no_torch_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a process in which ``import torch`` fails as if torch were not installed: a sitecustomize
    on PYTHONPATH puts a finder first on the meta path that refuses torch and its submodules."""
    site = tmp_path / "no_torch_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n\n\nclass _NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "        return None\n\n\nsys.meta_path.insert(0, _NoTorch())\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), str(ROOT / "tests")])}
