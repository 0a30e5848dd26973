"""The small fit of the callback tests: a linear model, 8 samples in batches of 2 (4 steps an epoch), validation
logging ``val_loss`` from a list indexed by epoch, seed 0 (tests/checkpointing/test_callback.py and the tests that reuse
it)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt.format import _atomic as atomic


STEPS_PER_EPOCH = 4


def _data() -> TensorDataset:
    g, n = torch.Generator().manual_seed(0), 2 * STEPS_PER_EPOCH
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def make_net_class(base: type) -> type:
    """The test module for a Lightning copy (``pl.LightningModule`` or ``lightning.pytorch.LightningModule``)."""

    class Net(base):  # type: ignore[misc, valid-type]
        def __init__(self, vals: list[float] | None = None, sleep: float = 0.0) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)
            self.vals = vals
            self.sleep = sleep
            self.steps_run = 0  # training steps this instance ran (a resumed run starts at 0)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.steps_run += 1
            if self.sleep:
                time.sleep(self.sleep)
            x, y = batch
            return nn.functional.mse_loss(self.layer(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if self.vals is not None:
                self.log("val_loss", torch.tensor(float(self.vals[self.current_epoch])))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    return Net


Net = make_net_class(pl.LightningModule)


def make_trainer(callback: Any, epochs: int, *, trainer_module: Any = pl, **trainer_kwargs: Any) -> Any:
    trainer_module.seed_everything(0, verbose=False)
    return trainer_module.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        max_epochs=epochs, callbacks=[callback], num_sanity_val_steps=0, **trainer_kwargs)


def run_fit(trainer: Any, vals: list[float] | None = None, *, ckpt_path: str | None = None, sleep: float = 0.0,
            net_class: type | None = None) -> Any:
    """Fit a fresh module (seeded by make_trainer); validation runs when ``vals`` is given. Returns the trainer."""
    model = (net_class or Net)(vals, sleep)
    trainer.fit(model, DataLoader(_data(), batch_size=2),
                DataLoader(_data(), batch_size=2 * STEPS_PER_EPOCH) if vals is not None else None,
                ckpt_path=ckpt_path)
    return trainer


def fit(callback: Any, epochs: int, vals: list[float] | None = None, *, ckpt_path: str | None = None,
        sleep: float = 0.0, trainer_module: Any = pl, net_class: type | None = None, **trainer_kwargs: Any) -> Any:
    """Train until ``epochs`` epochs are done (counting resumed ones) from seed 0."""
    trainer = make_trainer(callback, epochs, trainer_module=trainer_module, **trainer_kwargs)
    return run_fit(trainer, vals, ckpt_path=ckpt_path, sleep=sleep, net_class=net_class)


def name(epoch: int, step: int, version: int | None = None) -> str:
    return f"epoch={epoch}-step={step}" + (f"-v{version}" if version is not None else "") + ".ckpt"


def at_step(step: int) -> str:
    """The default file name of a save at the end of optimizer step ``step``."""
    return name((step - 1) // STEPS_PER_EPOCH, step)


def files_after_fit(directory: Any) -> set[str]:
    """Every entry of ``directory`` (hidden ones included) once replaced files are unlinked."""
    atomic.wait_for_cleanup()
    return set(os.listdir(directory)) if os.path.isdir(directory) else set()
