"""Habits Lightning's own ``ModelCheckpoint`` supports, checked against it (issue 23, point 5): ``monitor="step"`` and
``monitor="epoch"`` (Lightning's built-in candidates; its documented "keep the latest k" recipe), and ORT files behind
an ``http(s)`` URL for ``load_from_checkpoint`` and ``fit(ckpt_path=url)``."""

from __future__ import annotations

import functools
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

import lightning_ort_ckpt
from lightning_ort_ckpt import OrtCheckpoint, open_checkpoint


class Net(pl.LightningModule):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(width, 1)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, _: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=2)

    val_dataloader = train_dataloader


def _fit(callback: Any, root: Path, epochs: int = 3, ckpt_path: str | None = None) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback], default_root_dir=root,
                         num_sanity_val_steps=0)
    trainer.fit(Net(), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(autouse=True)
def _unseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.delenv("PL_SEED_WORKERS", raising=False)


@pytest.mark.parametrize("monitor, triggers", [("step", dict(every_n_train_steps=2)), ("epoch", {})])
def test_builtin_monitors_rank_as_modelcheckpoint_does(tmp_path: Path, monitor: str, triggers: dict) -> None:
    def run(cls: type, where: str) -> tuple[list[str], str, float]:
        cb = cls(dirpath=tmp_path / where, monitor=monitor, mode="max", save_top_k=2, filename="{epoch}-{step}",
                 **triggers)
        _fit(cb, tmp_path / where)
        return (sorted(os.listdir(tmp_path / where)), os.path.basename(cb.best_model_path),
                float(cb.best_model_score))

    native, ours = run(ModelCheckpoint, "native"), run(OrtCheckpoint, "ours")
    assert ours == native
    assert len(native[0]) == 2 and native[1]  # the latest two kept, and ranked


@pytest.fixture()
def http_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A plain HTTP server on 127.0.0.1 serving a folder (no range requests, like many static servers)."""
    root = tmp_path / "served"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_an_ort_file_behind_an_http_url_loads_and_resumes(tmp_path: Path, http_root: tuple[Path, str]) -> None:
    root, base = http_root
    cb = OrtCheckpoint(dirpath=root, filename="first", every_n_epochs=1, save_top_k=1, monitor="val_loss")
    _fit(cb, tmp_path / "a", epochs=2)
    url = f"{base}/first.ckpt"
    restored = lightning_ort_ckpt.load_from_checkpoint(Net, url)  # Lightning's loader, reading ORT files for this call
    with open_checkpoint(root / "first.ckpt") as reader:
        assert torch.equal(restored.layer.weight, reader.get_tensor("layer.weight"))
    trainer = _fit(OrtCheckpoint(dirpath=tmp_path / "b"), tmp_path / "b", epochs=3, ckpt_path=url)
    assert trainer.global_step == 12 and trainer.current_epoch == 3
