"""The model the logger tests fit (tests/lightning_side/test_loggers.py, tests/lightning_side/test_wandb_logger.py): one
linear layer that logs ``loss`` and ``val_loss``, 16 seeded samples in batches of 4."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        loss = self.layer(batch[0]).square().mean()
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: Any, _: int) -> None:
        self.log("val_loss", self.layer(batch[0]).square().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g)),
                                           batch_size=4)

    val_dataloader = train_dataloader
