"""Loading outside a Trainer (issue 33, point 3): one line in a fresh script
(``lightning_ort_ckpt.load_from_checkpoint`` and the torch-style ``lightning_ort_ckpt.load``), and
``Trainer.validate/test/predict(ckpt_path=...)`` whenever the Trainer has our callback or plugin."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_ort_ckpt import BindCheckpointIO, OrtCheckpoint, OrtCheckpointIO, open_checkpoint

HERE = Path(__file__).resolve().parent


class Net(pl.LightningModule):
    """Parameters, a buffer, hyperparameters, and every loop step."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width))
        self.head = torch.nn.Linear(width, 2)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def validation_step(self, batch: Any, _: int) -> None:
        self.seen.append("validate")
        self.log("val_loss", self(batch[0]).square().mean())

    def test_step(self, batch: Any, _: int) -> None:
        self.seen.append("test")

    def predict_step(self, batch: Any, _: int) -> torch.Tensor:
        self.seen.append("predict")
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def _data(self) -> Any:
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, self.hparams.width,
                                                                                      generator=g)), batch_size=4)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _data


def _trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ORT checkpoint of a trained ``Net(width=6)``, every file with a ``.data``."""
    where = tmp_path_factory.mktemp("trained")
    callback = OrtCheckpoint(dirpath=where, every_n_train_steps=4, external_data="all")
    _trainer(callbacks=[callback]).fit(Net(width=6))
    return Path(callback.best_model_path)


def _fresh(code: str) -> list[str]:
    """``code`` in a fresh Python: no callback or plugin of ours was ever built there."""
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
                          + textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=HERE.parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_one_line_loads_a_module_in_a_fresh_script(trained: Path) -> None:
    out = _fresh(f"""
        import torch, lightning_ort_ckpt
        from lightning_ort_ckpt import open_checkpoint
        from test_loading import Net
        model = lightning_ort_ckpt.load_from_checkpoint(Net, {str(trained)!r}, map_location="cpu")
        with open_checkpoint({str(trained)!r}) as reader:
            print(model.hparams.width, all(torch.equal(t, reader.get_tensor(n)) for n, t in model.state_dict().items()
                                          if n in reader.trainable or n in reader.frozen))
        try:  # ORT loading was on for that one call only: Lightning's own loader is back
            Net.load_from_checkpoint({str(trained)!r})
            print("torch read it")
        except Exception as e:
            print("refused", type(e).__name__)
    """)
    assert out[0] == "6 True"  # hyperparameters, parameters and BatchNorm's buffers are the file's
    assert out[1].startswith("refused")


def test_load_returns_lightnings_checkpoint_dict(trained: Path) -> None:
    out = _fresh(f"""
        import torch, lightning_ort_ckpt
        ckpt = lightning_ort_ckpt.load({str(trained)!r}, map_location="meta")
        print(sorted(k for k in ("state_dict", "optimizer_states", "epoch", "global_step", "hyper_parameters",
                                 "loops", "callbacks") if k in ckpt))
        print(ckpt["global_step"], ckpt["hyper_parameters"]["width"], ckpt["state_dict"]["head.weight"].device)
        print(sorted(k for k in ckpt if k.startswith("lightning_ort_ckpt")))  # our random states stay ours
    """)
    assert out == ["['callbacks', 'epoch', 'global_step', 'hyper_parameters', 'loops', 'optimizer_states', "
                   "'state_dict']", "4 6 meta", "[]"]


def test_load_reads_torch_checkpoints_too(tmp_path: Path) -> None:
    callback = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4)
    _trainer(callbacks=[callback]).fit(Net())
    import lightning_ort_ckpt

    ckpt = lightning_ort_ckpt.load(callback.best_model_path)
    expected = torch.load(callback.best_model_path, weights_only=True)["state_dict"]["head.weight"]
    assert ckpt["global_step"] == 4 and torch.equal(ckpt["state_dict"]["head.weight"], expected)
    model = lightning_ort_ckpt.load_from_checkpoint(Net, callback.best_model_path)
    assert torch.equal(model.head.weight, ckpt["state_dict"]["head.weight"])


@pytest.mark.parametrize("setup", ["callback", "plugin and BindCheckpointIO", "plugin alone"])
def test_validate_test_predict_read_our_checkpoint(trained: Path, setup: str) -> None:
    """Each stage with ``ckpt_path`` loads the file's weights (the model handed in starts elsewhere)."""
    for stage in ("validate", "test", "predict"):
        if setup == "callback":
            trainer = _trainer(callbacks=[OrtCheckpoint(dirpath=trained.parent / "unused")])
        else:
            trainer = _trainer(plugins=[OrtCheckpointIO()],
                               callbacks=[BindCheckpointIO()] if setup != "plugin alone" else [])
        model = Net(width=6)
        getattr(trainer, stage)(model, ckpt_path=str(trained))
        assert model.seen and set(model.seen) == {stage}
        with open_checkpoint(trained) as reader:
            assert torch.equal(model.head.weight, reader.get_tensor("head.weight"))


def test_load_reads_a_sharded_checkpoint_folder(tmp_path: Path) -> None:
    from lightning_ort_ckpt import load
    from lightning_ort_ckpt._dcp._dcp_storage import METADATA_NAME, save_sharded
    from lightning_ort_ckpt.errors import CorruptCheckpointError

    folder = tmp_path / "epoch=0-step=3.ckpt"
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    save_sharded({"state_dict": {"layer.weight": weight}, "global_step": 3, "epoch": 0}, str(folder))
    checkpoint = load(folder)
    assert checkpoint["global_step"] == 3 and torch.equal(checkpoint["state_dict"]["layer.weight"], weight)
    (folder / METADATA_NAME).write_text("{")
    with pytest.raises(CorruptCheckpointError, match=METADATA_NAME):
        load(folder)
