"""The model the preemption tests train, and their run's length (tests/conformance/test_preemption.py,
tests/checkpointing/test_tiers_signals.py)."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

MAX_STEPS = 12  # 2 epochs of 6 batches; validation every 3 training batches


class Net(pl.LightningModule):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.1), nn.Linear(width, width))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        print(f"validating {self.global_step} {batch_idx}", flush=True)
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
