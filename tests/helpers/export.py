"""The LightningModule the export tests write to a file and name by ``module:Class`` (tests/export_cli/test_export.py,
tests/export_cli/test_export_callback.py)."""

from __future__ import annotations

import textwrap


MODULE = textwrap.dedent('''
    import torch
    import pytorch_lightning as pl
    from torch import nn


    class Demo(pl.LightningModule):
        """BatchNorm and Dropout: export must run them in inference form."""

        def __init__(self, hidden: int = 16, lr: float = 1e-2):
            super().__init__()
            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Linear(8, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.3),
                                     nn.Linear(hidden, 2))
            self.example_input_array = torch.linspace(-2, 2, 32).reshape(4, 8)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self(x), y))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
''')
