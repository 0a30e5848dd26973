"""Deployment export: ONNX models from checkpoints, verified against the real ONNX Runtime."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_ort_ckpt
from lightning_ort_ckpt import CorruptCheckpointError, OrtCheckpoint, load_checkpoint, open_checkpoint
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.export import ExportError, export_onnx
from lightning_ort_ckpt.format import CheckpointContents, OptimizerGroup, save_checkpoint
from lightning_ort_ckpt._restore._reading import read_weights
from helpers.export import MODULE


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Demo run saved by OrtCheckpoint, best by val_loss, exported to export_best_to when fit ends."""
    root = tmp_path_factory.mktemp("export")
    (root / "demo_module.py").write_text(MODULE)
    sys.path.insert(0, str(root))
    try:
        from demo_module import Demo
    finally:
        sys.path.remove(str(root))
    pl.seed_everything(0)
    x = torch.randn(128, 8)
    data = TensorDataset(x, (x[:, :4].sum(1) > 0).long())
    callback = OrtCheckpoint(dirpath=root / "ckpts", monitor="val_loss", save_top_k=2, save_last=True,
                             export_best_to=root / "best.onnx")
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    trainer.fit(Demo(), DataLoader(data, batch_size=32, shuffle=True), DataLoader(data, batch_size=64))
    return root, Demo, callback


def ort_run(path: Path, x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x})[0]


def torch_run(module_class, checkpoint, x: np.ndarray) -> np.ndarray:
    module = lightning_ort_ckpt.load_from_checkpoint(module_class, checkpoint).eval()
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


def test_export_best_at_fit_end(trained):
    root, Demo, callback = trained
    report = callback.export_report
    assert report.path == str(root / "best.onnx") and report.checkpoint == callback.best_model_path
    assert report.max_abs_diff <= 1e-5 and report.monitor == "val_loss"
    assert report.score == pytest.approx(float(callback.best_model_score))
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)  # another batch size, other values
    np.testing.assert_allclose(ort_run(root / "best.onnx", x), torch_run(Demo, callback.best_model_path, x),
                               atol=1e-5, rtol=0)
    meta = {p.key: p.value for p in onnx.load(root / "best.onnx").metadata_props}
    assert meta["lightning_ort_ckpt.source_checkpoint"] == os.path.abspath(callback.best_model_path)
    assert meta["lightning_ort_ckpt.monitor"] == "val_loss"
    assert float(meta["lightning_ort_ckpt.score"]) == report.score
    assert int(meta["lightning_ort_ckpt.global_step"]) == report.global_step > 0


def test_export_with_external_data(trained, tmp_path):
    root, Demo, callback = trained
    out = tmp_path / "ext" / "model.onnx"
    report = export_onnx(Demo, callback.last_model_path, out, external_data=True)
    assert report.external_data and (tmp_path / "ext" / "model.onnx.data").exists()
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in onnx.load(out, load_external_data=False)
               .graph.initializer if t.dims)
    x = np.ones((3, 8), np.float32)
    np.testing.assert_allclose(ort_run(out, x), torch_run(Demo, callback.last_model_path, x), atol=1e-5, rtol=0)


def test_export_into_a_module_instance(trained, tmp_path):
    root, Demo, callback = trained
    report = export_onnx(Demo(), callback.best_model_path, tmp_path / "m.onnx")
    assert report.max_abs_diff <= 1e-5


def test_failed_parity_writes_nothing(trained, tmp_path):
    root, Demo, callback = trained
    out = tmp_path / "never.onnx"
    with pytest.raises(ExportError, match="more than the tolerance"):
        export_onnx(Demo, callback.best_model_path, out, tolerance=0.0,
                    example_input=torch.full((2, 8), 1e3))  # large inputs: float rounding differs somewhere
    assert not out.exists() and os.listdir(tmp_path) == []


def test_no_example_input(trained, tmp_path):
    root, Demo, callback = trained
    module = Demo()
    module.example_input_array = None
    with pytest.raises(ExportError, match="no example input"):
        export_onnx(module, callback.best_model_path, tmp_path / "m.onnx")


def test_cli_export(trained, tmp_path):
    root, Demo, callback = trained
    out = tmp_path / "cli.onnx"
    result = subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", "export", callback.best_model_path,
                             "--module", f"{root / 'demo_module.py'}:Demo", "--output", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "max abs difference" in result.stdout and out.exists()
    bad = subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", "export", callback.best_model_path,
                          "--module", "no_such_module_here:Demo", "--output", str(tmp_path / "x.onnx")],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "no_such_module_here" in bad.stderr


def test_torch_checkpoints_export_and_make_artifacts(trained, tmp_path):
    """A .ckpt that Lightning's own ModelCheckpoint wrote (torch format) is accepted, as the docs and --help say."""
    from lightning_ort_ckpt.artifacts import make_training_artifacts

    root, Demo, callback = trained
    module = lightning_ort_ckpt.load_from_checkpoint(Demo, callback.best_model_path)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.strategy.connect(module)
    torch_ckpt = tmp_path / "torch.ckpt"
    trainer.save_checkpoint(torch_ckpt)
    assert torch_ckpt.read_bytes()[:2] == b"PK"  # a torch zip file, not ORT
    report = export_onnx(Demo, torch_ckpt, tmp_path / "from_torch.onnx")
    x = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_allclose(ort_run(tmp_path / "from_torch.onnx", x), ort_run(root / "best.onnx", x), atol=1e-5)
    assert report.max_abs_diff <= 1e-5
    artifacts = make_training_artifacts(Demo, torch_ckpt, tmp_path / "artifacts")
    assert os.path.exists(artifacts.checkpoint) and os.path.exists(artifacts.training_model)
    cli = subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", "export", str(torch_ckpt), "--module",
                          f"{root / 'demo_module.py'}:Demo", "--output", str(tmp_path / "cli.onnx")],
                         capture_output=True, text=True)
    assert cli.returncode == 0 and "max abs difference" in cli.stdout, cli.stderr


class NoHparams(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, 1)
        self.example_input_array = torch.zeros(1, width)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NoExampleInput(NoHparams):
    def __init__(self, width: int = 4) -> None:
        super().__init__(width)
        self.example_input_array = None


@pytest.mark.parametrize("module, tolerance, message", [
    (NoHparams(4), 1e-5, "arguments width are not saved"),
    (NoExampleInput(), 1e-5, "needs an example input"),
    (NoExampleInput(), "1e-5", "export_tolerance must be a number"),
], ids=["no-hparams", "no-example-input", "tolerance-as-text"])
def test_misconfigured_export_best_to_stops_before_training(module, tolerance, message, tmp_path):
    callback = OrtCheckpoint(dirpath=tmp_path / "ckpts", export_best_to=tmp_path / "m.onnx",
                             export_tolerance=tolerance)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    with pytest.raises(ExportError, match=message):
        trainer.fit(module, DataLoader(TensorDataset(torch.zeros(4, 4)), batch_size=2))
    assert trainer.global_step == 0 and not (tmp_path / "ckpts").exists()


def test_export_reads_the_module_tensors_only(tmp_path):
    """``read_weights`` (what export reads): the module's tensors, verified, and none of the optimizer's, so a
    damaged moment, which a full load refuses, is never read; a file ORT alone wrote keeps its optimizer step as
    ``global_step``."""
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "plain.ckpt"
    save_checkpoint(CheckpointContents(trainable={"w": w}, optimizer_groups={"group0": OptimizerGroup(
        7, 1e-3, {"w": {"momentum0": torch.ones_like(w), "momentum1": torch.ones_like(w)}})}), path)
    with open_checkpoint(path) as reader:
        moment = reader.optimizer_groups["group0"].states["w"]["momentum1"]
    with open(path, "r+b") as f:
        f.seek(moment.offset + 1000)
        f.write(b"\x7f")
    with pytest.raises(CorruptCheckpointError, match="momentum1"):
        load_checkpoint(path)
    with pytest.warns(CheckpointWarning, match="written by ONNX Runtime"):
        state = read_weights(path)
    assert torch.equal(state["state_dict"]["w"], w) and state["global_step"] == 7
    assert "optimizer_states" not in state
    with open_checkpoint(path) as reader:
        weight = reader.trainable["w"]
    with open(path, "r+b") as f:  # damage to a weight is caught
        f.seek(weight.offset + 1000)
        f.write(b"\x7f")
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        read_weights(path)
