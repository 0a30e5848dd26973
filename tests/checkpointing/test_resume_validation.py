"""A resume from a save that validation follows is bitwise the uninterrupted run (a bug found testing signals).

``every_n_train_steps=3`` with ``val_check_interval=3`` saves at step 3's batch end, before the validation that
follows that batch. Lightning resumes such a file past that validation (its loops skip it), so whatever validation
draws from the global generators (a shuffled validation loader, ``torch.rand`` in ``validation_step``) is not drawn,
its metrics are not logged, and every random number after it differs. The resumed fit must run that validation:
final weights, optimizer state, random states and the validation values logged are the uninterrupted run's.
Real Trainers in one process; the resume starts from the uninterrupted run's own file of that step.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import OrtCheckpoint, OrtCheckpointIO

STEPS = 14  # epochs of 10 batches: validation after steps 3, 6, 9 of each


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.drop = torch.nn.Dropout(0.5)
        self.logged: list[tuple[int, float]] = []  # (step, validation value) of each validation

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self.drop(self.layer(x)) - y).square().mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        noise = torch.rand(1).item() + random.random() + float(np.random.rand())
        self.log("val_loss", (self.layer(x) - y).square().mean() + noise)

    def on_validation_epoch_end(self) -> None:
        self.logged.append((self.global_step, float(self.trainer.callback_metrics["val_loss"])))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g)),
                          batch_size=4, shuffle=True)

    def val_dataloader(self) -> DataLoader:  # shuffled from torch's global generator at every validation
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)),
                          batch_size=4, shuffle=True)


def fit(root: Path, how: str, ckpt_path: Path | None = None) -> tuple[Net, pl.Trainer, dict[str, Any]]:
    pl.seed_everything(5)
    model = Net()
    if how == "plugin":
        callbacks: list[Any] = [ModelCheckpoint(root, every_n_train_steps=3, save_top_k=-1)]
        plugins: list[Any] = [OrtCheckpointIO()]
    else:
        callbacks, plugins = [OrtCheckpoint(root, every_n_train_steps=3, save_top_k=-1,
                                            async_save=how == "async")], []
    trainer = pl.Trainer(max_steps=STEPS, val_check_interval=3, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=callbacks, plugins=plugins)
    trainer.fit(model, ckpt_path=ckpt_path)
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    return model, trainer, states


def saved_at(root: Path, step: int) -> Path:
    (path,) = root.glob(f"*step={step}*.ckpt")
    return path


def assert_same_optimizer_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for key, value in a["state"][i].items():
            assert torch.equal(value, b["state"][i][key]), (i, key)


@pytest.mark.parametrize("step", [3, 6])
@pytest.mark.parametrize("how", ["sync", "async", "plugin"])
def test_a_save_before_validation_resumes_bitwise(tmp_path: Path, how: str, step: int) -> None:
    straight, straight_trainer, straight_states = fit(tmp_path / "straight", how)
    resumed, resumed_trainer, resumed_states = fit(tmp_path / "resumed", how,
                                                   saved_at(tmp_path / "straight", step))
    assert resumed.logged == [(s, v) for s, v in straight.logged if s >= step]  # the validation after the save ran
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert_same_optimizer_state(straight_trainer.optimizers[0].state_dict(),
                                resumed_trainer.optimizers[0].state_dict())
    assert torch.equal(straight_states["torch"], resumed_states["torch"])
    assert straight_states["python"] == resumed_states["python"]
    a, b = straight_states["numpy"], resumed_states["numpy"]
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]
    assert resumed_trainer.global_step == straight_trainer.global_step == STEPS
    assert (resumed_trainer.fit_loop.state_dict() == straight_trainer.fit_loop.state_dict())  # no batch, no
    # validation counted twice or skipped
