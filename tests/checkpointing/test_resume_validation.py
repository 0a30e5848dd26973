"""A resume from a save that validation follows is bitwise the uninterrupted run (a bug found testing signals).

``every_n_train_steps=3`` with ``val_check_interval=3`` saves at step 3's batch end, before the validation that
follows that batch. Lightning resumes such a file past that validation (its loops skip it), so whatever validation
draws from the global generators (a shuffled validation loader, ``torch.rand`` in ``validation_step``) is not drawn,
its metrics are not logged, and every random number after it differs. The resumed fit must run that validation:
final weights, optimizer state, random states, the validation values logged and the loops' counters are the
uninterrupted run's. The same for the validation at the end of an epoch (a save on its last batch), which Lightning
skips with the rest of that epoch's end. Real Trainers in one process, with their sanity check; the resume starts
from the uninterrupted run's own file of that step.
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
from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
from lightning_ort_ckpt.errors import CheckpointWarning

STEPS = 14  # epochs of 10 batches
INTERVAL = {"val_check_interval": 3}  # validation after batches 3, 6, 9 of each epoch
EPOCH_END = {}  # validation at the end of each epoch: after its last batch


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


def fit(root: Path, how: str, ckpt_path: Path | None = None, every: int = 3, steps: int = STEPS,
        options: dict[str, Any] = INTERVAL) -> tuple[Net, pl.Trainer, dict[str, Any]]:
    pl.seed_everything(5)
    model = Net()
    if how == "plugin":
        callbacks: list[Any] = [ModelCheckpoint(root, every_n_train_steps=every, save_top_k=-1)]
        plugins: list[Any] = [OrtCheckpointIO()]
    else:
        callbacks, plugins = [OrtCheckpoint(root, every_n_train_steps=every, save_top_k=-1,
                                            async_save=how == "async")], []
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, plugins=plugins, **options)
    trainer.fit(model, ckpt_path=ckpt_path)
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    return model, trainer, states


def saved_at(root: Path, step: int) -> Path:
    (path,) = [p for p in root.glob("*.ckpt") if f"step={step}." in p.name or f"step={step}-" in p.name]
    return path


def assert_same_optimizer_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for key, value in a["state"][i].items():
            assert torch.equal(value, b["state"][i][key]), (i, key)


CASES = [(how, step, INTERVAL, 3, STEPS) for step in (3, 6) for how in ("sync", "async", "plugin")] + [
    ("sync", 10, EPOCH_END, 5, 25), ("async", 20, EPOCH_END, 5, 25), ("plugin", 10, EPOCH_END, 5, 25)]


SMOKE = {("sync", 3), ("sync", 10)}  # on the floor Lightning too (scripts/floor.sh): the loop layout rewritten


@pytest.mark.parametrize(("how", "step", "options", "every", "steps"), [
    pytest.param(*c, id=f"{c[0]}-step{c[1]}-{'interval' if c[2] else 'epoch_end'}",
                 marks=[pytest.mark.smoke] if c[:2] in SMOKE else []) for c in CASES])
def test_a_save_before_validation_resumes_bitwise(tmp_path: Path, how: str, step: int, options: dict[str, Any],
                                                  every: int, steps: int) -> None:
    """The uninterrupted fit (with its sanity check) against one resumed from its own file of ``step``."""
    straight, straight_trainer, straight_states = fit(tmp_path / "straight", how, None, every, steps, options)
    resumed, resumed_trainer, resumed_states = fit(tmp_path / "resumed", how, saved_at(tmp_path / "straight", step),
                                                   every, steps, options)
    assert resumed.logged == [(s, v) for s, v in straight.logged if s >= step]  # the validation after the save ran
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert_same_optimizer_state(straight_trainer.optimizers[0].state_dict(),
                                resumed_trainer.optimizers[0].state_dict())
    assert torch.equal(straight_states["torch"], resumed_states["torch"])
    assert straight_states["python"] == resumed_states["python"]
    a, b = straight_states["numpy"], resumed_states["numpy"]
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]
    assert resumed_trainer.global_step == straight_trainer.global_step == steps
    assert resumed_trainer.fit_loop.state_dict() == straight_trainer.fit_loop.state_dict()
    later = [read_lightning_checkpoint(saved_at(tmp_path / run, step + every))["loops"]
             for run in ("straight", "resumed")]
    assert later[0] == later[1]  # the loops count no batch, no validation batch, twice or not at all


def test_a_trainer_that_does_not_validate_there_says_what_differs(tmp_path: Path) -> None:
    fit(tmp_path / "straight", "sync")
    with pytest.warns(CheckpointWarning, match="before the validation after step 3, which this Trainer does not run"):
        fit(tmp_path / "resumed", "sync", saved_at(tmp_path / "straight", 3), options={"val_check_interval": 4})


def test_only_a_save_that_validation_follows_records_it(tmp_path: Path) -> None:
    """Saves at every step: those of steps 3, 6, 9 and 13 (10 batches an epoch) come before a validation; the
    others resume as Lightning resumes them."""
    from lightning_ort_ckpt._fit_state._validation_resume import VALIDATION_KEY

    fit(tmp_path, "sync", every=1)
    recorded = {}
    for step in range(1, STEPS + 1):
        checkpoint = read_lightning_checkpoint(saved_at(tmp_path, step))
        if VALIDATION_KEY in checkpoint:
            recorded[step] = checkpoint[VALIDATION_KEY]
    assert recorded == {3: 3, 6: 6, 9: 9, 13: 13}


class StopAt(pl.Callback):
    """Asks the fit to stop at the end of a step (before the checkpoint callback saves it): Lightning validates
    then, and stops."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def test_a_validation_the_resume_cannot_decide_is_named(tmp_path: Path) -> None:
    """The validation after step 4 ran because the fit was stopping (``should_stop``), which a resumed fit does not
    know: its file records that, and the resume warns that the validation is not run."""
    pl.seed_everything(5)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, val_check_interval=3,
                         callbacks=[StopAt(4), OrtCheckpoint(tmp_path / "stopped", every_n_train_steps=2,
                                                             save_top_k=-1)])
    trainer.fit(Net())
    assert trainer.global_step == 4
    with pytest.warns(CheckpointWarning, match="validation after step 4, which ran by elapsed time or because the "
                                               "fit was stopping"):
        fit(tmp_path / "resumed", "sync", saved_at(tmp_path / "stopped", 4))
