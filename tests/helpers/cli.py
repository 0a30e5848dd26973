"""The command line in a fresh interpreter (``python -m lightning_ort_ckpt``), and an environment without torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

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


class Net(pl.LightningModule):
    """The run the CLI tests list and check: a trained head (2 parameters), BatchNorm (2 parameters the optimizer leaves alone, 3 buffers), and a frozen
    1 MiB layer (shared .data)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(512, 512, bias=False)
        self.frozen.requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(512)
        self.head = torch.nn.Linear(512, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.frozen(x)))

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def validation_step(self, batch: Any, _: int) -> None:
        self.log("val_loss", self(batch[0]).square().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.head.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 512, generator=g)),
                                           batch_size=4)

    val_dataloader = train_dataloader
