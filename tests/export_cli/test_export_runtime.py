"""The export check runs on whichever ONNX Runtime is installed (issue 42, point 1) and says which: the maintained
``onnxruntime`` of the ``deploy`` extra (scripts/deploy.sh, no onnxruntime-training) or onnxruntime-training
1.19.2 of the ``ort`` extra (the main suite)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnxruntime
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import OrtCheckpoint, load_from_checkpoint
from lightning_ort_ckpt.export import export_onnx


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))
        self.example_input_array = torch.linspace(-1, 1, 12).reshape(2, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_the_check_runs_on_the_installed_runtime_and_names_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    callback = OrtCheckpoint(dirpath=tmp_path / "ckpts", save_last=True, export_best_to=tmp_path / "best.onnx")
    pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=[callback]).fit(Tiny(), DataLoader(TensorDataset(torch.randn(12, 6)), batch_size=4))
    package = "onnxruntime-training" if importlib.util.find_spec("onnxruntime.training") else "onnxruntime"
    expected = f"{onnxruntime.__version__} ({package})"
    assert callback.export_report.onnxruntime == expected
    report = export_onnx(Tiny, callback.last_model_path, tmp_path / "again.onnx")
    assert report.onnxruntime == expected and f"ONNX Runtime {expected} vs torch" in str(report)
    x = torch.randn(5, 6)  # another batch size than the example's
    session = onnxruntime.InferenceSession(str(tmp_path / "again.onnx"), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = load_from_checkpoint(Tiny, callback.last_model_path).eval()(x).numpy()
    np.testing.assert_allclose(session.run(None, {"input": x.numpy()})[0], want, atol=1e-5, rtol=0)
