"""A module with extra state that is not a tensor (``get_extra_state`` returning a dict, as stateful layers do)
saves and resumes, with ``ckpt_path`` and with ``"last"`` (found in the field: the dict was stored as a frozen
"tensor" and read back as an array, so every file of such a run was unresumable)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

import lightning_ort_ckpt
from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.format import load_checkpoint


class Counter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen = torch.zeros(2)
        self.calls = 0

    def get_extra_state(self) -> Any:
        return {"seen": self.seen.clone(), "calls": self.calls, "name": "counter"}

    def set_extra_state(self, state: Any) -> None:
        self.seen, self.calls = state["seen"], state["calls"]


class WithExtraState(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.counter = Counter()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.counter.seen += batch.sum(0)
        self.counter.calls += 1
        return self.layer(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.001)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.arange(16.0).reshape(8, 2), batch_size=2)


def fit(dirpath: Path, epochs: int, ckpt_path: str | None = None) -> WithExtraState:
    torch.manual_seed(0)
    model = WithExtraState()
    pl.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=[OrtCheckpoint(dirpath=dirpath, save_last=True)]).fit(model, ckpt_path=ckpt_path)
    return model


@pytest.mark.parametrize("how", ["path", "last"])
def test_extra_state_that_is_no_tensor_resumes(tmp_path: Path, how: str) -> None:
    straight = fit(tmp_path / "straight", 3)
    fit(tmp_path / "run", 2)
    resumed = fit(tmp_path / "run", 3, "last" if how == "last" else str(tmp_path / "run" / "last.ckpt"))
    assert resumed.counter.calls == straight.counter.calls == 12
    assert torch.equal(resumed.counter.seen, straight.counter.seen)
    assert torch.equal(resumed.layer.weight, straight.layer.weight)


def test_extra_state_is_in_the_file_for_lightning_and_out_of_orts_way(tmp_path: Path) -> None:
    fit(tmp_path, 1)
    state = lightning_ort_ckpt.load(str(tmp_path / "last.ckpt"))["state_dict"]["counter._extra_state"]
    assert state["calls"] == 4 and state["name"] == "counter" and torch.equal(state["seen"], torch.tensor([56., 64.]))
    ck = load_checkpoint(tmp_path / "last.ckpt")
    assert "counter._extra_state" not in {**ck.trainable, **ck.frozen}  # ORT sees tensors only
