"""The small classifier the examples train: BatchNorm and Dropout, data generated in code (nothing downloaded)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class DemoModel(pl.LightningModule):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear, trained with AdamW and cross-entropy."""

    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 3, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(hidden, classes))
        self.example_input_array = torch.linspace(-1, 1, 4 * features).reshape(4, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def make_data(n: int = 2048, features: int = 16, classes: int = 3, seed: int = 0) -> TensorDataset:
    """Noisy samples around ``classes`` fixed centres (the same for every ``seed``, which picks the samples)."""
    centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centres[y] + torch.randn(n, features, generator=g), y)


def loaders(batch_size: int = 64) -> tuple[DataLoader, DataLoader]:
    train, val = make_data(seed=0), make_data(n=512, seed=1)
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=256)
