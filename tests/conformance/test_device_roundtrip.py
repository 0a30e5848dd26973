"""The full round trip, BatchNorm and Dropout included: Lightning fit with OrtCheckpoint -> best checkpoint -> ORT
training artifacts -> ORT Module + Optimizer train and save -> Lightning fit(ckpt_path=ORT's file) -> ONNX export ->
InferenceSession equals torch within 1e-5. Everything real: Lightning's Trainer, onnxruntime-training 1.19.2."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import pytorch_lightning as pl
import torch

import lightning_ort_ckpt
from lightning_ort_ckpt import OrtCheckpoint, load_checkpoint, open_checkpoint
from lightning_ort_ckpt.artifacts import make_training_artifacts
from lightning_ort_ckpt.export import export_onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from demo_model import DemoModel, loaders  # noqa: E402

ORT_STEPS = 12


class Snapshot(pl.Callback):
    """The weights and AdamW state right after the checkpoint was restored, before any further step."""

    def on_train_start(self, trainer, pl_module):
        self.weights = {k: v.clone() for k, v in pl_module.state_dict().items()}
        opt = trainer.optimizers[0]
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.moments = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def fit(tmp: Path, name: str, epochs: int, ckpt_path=None, callbacks=()):
    callback = OrtCheckpoint(dirpath=tmp / name, monitor="val_loss", save_top_k=1, save_last=True)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback, *callbacks])
    trainer.fit(DemoModel(), *loaders(), ckpt_path=ckpt_path)
    return callback, trainer


def test_lightning_ort_lightning_deploy(tmp_path):
    onnxruntime.set_default_logger_severity(3)
    from onnxruntime.training import api

    pl.seed_everything(0, verbose=False)
    first, _ = fit(tmp_path, "lightning", 1)
    art = make_training_artifacts(DemoModel, first.best_model_path, tmp_path / "artifacts")
    assert set(art.trainable) == {n for n, _ in DemoModel().named_parameters()}
    assert set(art.frozen) == {"net.1.running_mean", "net.1.running_var"}

    state = api.CheckpointState.load_checkpoint(art.checkpoint)
    module = api.Module(art.training_model, state, art.eval_model)
    optimizer = api.Optimizer(art.optimizer_model, module)
    optimizer.set_learning_rate(3e-3)
    module.train()
    before = {n: state.parameters[n].data.copy() for n in art.trainable + art.frozen}
    losses = []
    for _, (x, y) in zip(range(ORT_STEPS), loaders()[0]):
        losses.append(float(module(x.numpy(), y.numpy())))
        optimizer.step()
        module.lazy_reset_grad()
    assert all(np.isfinite(losses))
    for name in art.trainable + art.frozen:  # weights trained, BatchNorm statistics updated in place
        assert not np.array_equal(state.parameters[name].data, before[name]), name
    module.eval()
    x, y = next(iter(loaders()[1]))
    assert np.isfinite(float(module(x.numpy(), y.numpy())))  # the repaired eval model loads and runs
    ort_file = tmp_path / "ort_trained.ckpt"
    api.CheckpointState.save_checkpoint(state, str(ort_file), include_optimizer_state=True)
    with open_checkpoint(first.best_model_path) as start, open_checkpoint(ort_file) as trained:
        assert trained.optimizer_groups["group0"].step == start.optimizer_groups["group0"].step + ORT_STEPS

    snapshot = Snapshot()
    with pytest.warns(UserWarning, match="ONNX Runtime trained 12 more optimizer steps"):
        resumed, trainer = fit(tmp_path, "resumed", 2, ckpt_path=str(ort_file), callbacks=[snapshot])
    ort = load_checkpoint(ort_file)
    for name, value in {**ort.trainable, **ort.frozen}.items():
        if not name.startswith("lightning:"):
            assert torch.equal(snapshot.weights[name], value), name
    for name, moments in ort.optimizer_groups["group0"].states.items():
        assert torch.equal(snapshot.moments[name]["exp_avg"], moments["momentum0"]), name
        assert torch.equal(snapshot.moments[name]["exp_avg_sq"], moments["momentum1"]), name
        assert float(snapshot.moments[name]["step"]) == ort.optimizer_groups["group0"].step
    assert trainer.global_step > 0

    report = export_onnx(DemoModel, resumed.best_model_path, tmp_path / "model.onnx")
    x = np.random.default_rng(3).standard_normal((7, 16)).astype(np.float32)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    torch_module = lightning_ort_ckpt.load_from_checkpoint(DemoModel, resumed.best_model_path).eval()
    with torch.no_grad():
        expected = torch_module(torch.from_numpy(x)).numpy()
    assert np.max(np.abs(session.run(None, {"input": x})[0] - expected)) <= 1e-5
    assert report.max_abs_diff <= 1e-5
