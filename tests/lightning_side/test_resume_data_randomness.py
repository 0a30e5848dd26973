"""Resume trains on the same data as the uninterrupted run when the data itself is random.

Lightning's own ``BoringModel`` builds a ``RandomDataset`` in ``train_dataloader()`` (so do ``random_split`` and
subset sampling in the hook). The random states a checkpoint carries must be restored where the uninterrupted run
had them: after Lightning built the loaders (``train_dataloader()`` then draws what the uninterrupted run drew at its
start), and before the next epoch's shuffle is drawn. Checked bitwise against the uninterrupted run, for a save at
the end of an epoch and one inside it, with ``OrtCheckpoint`` and with the bare plugin plus ``BindCheckpointIO``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_ort_ckpt import BindCheckpointIO, OrtCheckpoint, OrtCheckpointIO

BATCHES = 4  # per epoch


class RandomDataModel(pl.LightningModule):
    """BoringModel's habit: the dataset is drawn from the global generator inside ``train_dataloader()``."""

    def __init__(self, shuffle: bool = True) -> None:
        super().__init__()
        self.shuffle = shuffle
        self.layer = torch.nn.Linear(8, 2)
        self.drop = torch.nn.Dropout(0.3)  # randomness during training, too

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        return self.drop(self.layer(batch)).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        self.data = torch.randn(BATCHES * 4, 8)  # drawn here, as RandomDataset draws it
        return torch.utils.data.DataLoader(self.data, batch_size=4, shuffle=self.shuffle)


def _fit(tmp: Path, steps: int, callbacks: list[Any], plugins: list[Any] | None = None,
         ckpt_path: str | None = None, shuffle: bool = True) -> RandomDataModel:
    pl.seed_everything(0)
    model = RandomDataModel(shuffle)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, plugins=plugins, default_root_dir=tmp)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


@pytest.fixture(autouse=True)
def _unseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)


@pytest.mark.parametrize("save_at, shuffle", [(BATCHES, True), (BATCHES + 2, False), (BATCHES + 2, True)],
                         ids=["epoch-end", "mid-epoch", "mid-epoch-shuffled"])
@pytest.mark.parametrize("how", ["callback", "plugin"])
def test_resume_draws_the_same_data_and_shuffles(tmp_path: Path, save_at: int, shuffle: bool, how: str) -> None:
    """The data drawn in ``train_dataloader()``, and everything else, bit for bit: at an epoch's end, and inside an
    epoch (the data position), shuffled or not."""
    total = 3 * BATCHES
    reference = _fit(tmp_path / "straight", total, [], shuffle=shuffle)

    def tools(where: Path) -> tuple[list[Any], list[Any] | None]:
        if how == "callback":
            return [OrtCheckpoint(dirpath=where, every_n_train_steps=save_at, save_top_k=-1)], None
        return ([ModelCheckpoint(dirpath=where, every_n_train_steps=save_at, save_top_k=-1), BindCheckpointIO()],
                [OrtCheckpointIO()])

    callbacks, plugins = tools(tmp_path / "ckpts")
    _fit(tmp_path / "first", save_at, callbacks, plugins, shuffle=shuffle)
    (saved,) = (tmp_path / "ckpts").glob("*.ckpt")
    callbacks, plugins = tools(tmp_path / "ckpts2")
    resumed = _fit(tmp_path / "second", total, callbacks, plugins, ckpt_path=str(saved), shuffle=shuffle)
    assert torch.equal(resumed.data, reference.data), "train_dataloader() drew other data than the uninterrupted run"
    for name, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), f"{name} differs from the uninterrupted run"
