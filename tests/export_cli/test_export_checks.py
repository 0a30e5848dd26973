"""What export and training artifacts check before they report success (issue 23), with the real Lightning Trainer,
torch exporter and onnxruntime-training 1.19.2: the rebuilt module is the trained one, an export that cannot work
fails at setup with one line, the eval model is not random, modules with several inputs train in ORT, and ORT's
training step is tried before artifacts are returned."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("onnxruntime.training")

from lightning_ort_ckpt import OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt.artifacts import ArtifactsError, make_training_artifacts
from lightning_ort_ckpt.export import ExportError, export_onnx
from lightning_ort_ckpt.format import save_checkpoint
from lightning_ort_ckpt._translation.lightning_dict import ModuleInfo, to_ort
from helpers.ort_reference import ort_api

api = ort_api()


def trainer(tmp_path: Any, callbacks: list[Any] = (), **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, callbacks=list(callbacks),
                      **({"plugins": [OrtCheckpointIO()], "enable_checkpointing": False} if not callbacks else {}),
                      **kwargs)


def data() -> DataLoader:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)


class Unsaved(pl.LightningModule):
    """Every __init__ argument has a default, and save_hyperparameters() is never called: load_from_checkpoint
    builds it with the defaults."""

    def __init__(self, width: int = 4, act: str = "relu") -> None:
        super().__init__()
        self.fc = nn.Linear(6, width)
        self.act = nn.Tanh() if act == "tanh" else nn.ReLU()
        self.out = nn.Linear(width, 2)
        self.example_input_array = torch.linspace(-2, 2, 12).reshape(2, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.fc(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def saved(module: pl.LightningModule, path: Any) -> str:
    t = trainer(path.parent, max_steps=1)
    t.fit(module, data())
    t.save_checkpoint(path)
    return str(path)


# -- point 3: the rebuilt module is the one that was trained -----------------------------------------------------


def test_unsaved_arguments_that_change_shapes_stop_fit_at_setup(tmp_path: Any) -> None:
    callback = OrtCheckpoint(dirpath=tmp_path / "ckpts", export_best_to=tmp_path / "m.onnx")
    t = trainer(tmp_path, [callback], max_epochs=1)
    with pytest.raises(ExportError, match=r"fc.weight is \[4, 6\] there, \[16, 6\] here.*arguments width, act are "
                                          r"not saved; call self.save_hyperparameters"):
        t.fit(Unsaved(width=16), data())
    assert t.global_step == 0 and not (tmp_path / "ckpts").exists()


def test_shape_mismatch_on_load_names_the_unsaved_arguments(tmp_path: Any) -> None:
    path = saved(Unsaved(width=16), tmp_path / "wide.ckpt")
    with pytest.raises(ExportError) as info:
        export_onnx(Unsaved, path, tmp_path / "m.onnx")
    message = str(info.value)
    assert message.startswith(f"{path}: the checkpoint's weights do not fit Unsaved built from its saved "
                              "hyperparameters (size mismatch for fc.weight"), message
    assert "arguments width, act are not in the saved hyperparameters" in message and "\n" not in message
    assert not (tmp_path / "m.onnx").exists()


def test_the_rebuilt_module_is_compared_with_the_trained_one(tmp_path: Any) -> None:
    """Shapes agree, so the weights load; the activation does not: the export would silently be of another model.
    Given the trained module as ``reference`` (what the callback passes at the end of fit), export refuses."""
    live = Unsaved(act="tanh")
    path = saved(live, tmp_path / "tanh.ckpt")
    assert export_onnx(Unsaved, path, tmp_path / "wrong.onnx").max_abs_diff <= 1e-5  # "verified", but ReLU
    with pytest.raises(ExportError, match=r"Unsaved rebuilt from the checkpoint's hyperparameters computes other "
                                          r"outputs than the module that was trained.*arguments width, act are not"):
        export_onnx(Unsaved, path, tmp_path / "m.onnx", reference=live)
    assert not (tmp_path / "m.onnx").exists()
    assert live.training  # the trained module is left as it was
    same = Unsaved(act="relu")
    report = export_onnx(Unsaved, saved(same, tmp_path / "relu.ckpt"), tmp_path / "ok.onnx", reference=same)
    assert report.max_abs_diff <= 1e-5


# -- point 6: what would fail at the end of fit fails at setup, in one line ------------------------------------------


class Spectral(Unsaved):
    """``torch.fft.rfft`` has no ONNX export at opset 17."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.fft.rfft(x, n=10).abs())


def test_an_export_that_cannot_work_stops_fit_at_setup_without_the_graph_dump(tmp_path: Any, capfd: Any) -> None:
    callback = OrtCheckpoint(dirpath=tmp_path / "ckpts", export_best_to=tmp_path / "m.onnx")
    t = trainer(tmp_path, [callback], max_epochs=1)
    with pytest.raises(ExportError) as info:
        t.fit(Spectral(), data())
    assert t.global_step == 0 and not (tmp_path / "ckpts").exists()
    assert "\n" not in str(info.value) and "aten::fft_rfft" in str(info.value)
    assert "Torch IR graph" not in capfd.readouterr().out
    path = saved(Unsaved(), tmp_path / "plain.ckpt")
    module = Spectral()
    with pytest.raises(ExportError, match="aten::fft_rfft"):
        export_onnx(module, path, tmp_path / "m.onnx", verbose=True)
    assert "Torch IR graph at exception" in capfd.readouterr().out  # verbose: the exporter's own report


# -- point 2: ORT's eval model is torch's eval() ---------------------------------------------------------------------


def start_checkpoint(model: nn.Module, path: Any) -> str:
    save_checkpoint(to_ort({"state_dict": model.state_dict()}, ModuleInfo({n for n, _ in model.named_parameters()},
                                                                          [])), path)
    return str(path)


class AlwaysDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(nn.functional.dropout(x, 0.5, training=True))  # random in eval mode too


def test_a_forward_random_in_eval_mode_is_refused(tmp_path: Any) -> None:
    model = AlwaysDropout()
    path = start_checkpoint(model, tmp_path / "start.ckpt")
    with pytest.raises(ArtifactsError, match=r"forward is random in eval mode \(Dropout .*draw random numbers only "
                                             r"when self.training"):
        make_training_artifacts(model, path, tmp_path / "art", example_input=torch.randn(2, 6))
    assert {"training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"}.isdisjoint(
        os.listdir(tmp_path / "art"))


# -- point 4: several inputs; ORT's training step is tried -----------------------------------------------------------


def test_lightnings_demo_transformer_with_two_inputs_trains_in_ort_at_another_batch_size(tmp_path: Any) -> None:
    from pytorch_lightning.demos.transformer import LightningTransformer, Transformer

    torch.manual_seed(0)
    model = LightningTransformer(vocab_size=16)
    model.model = Transformer(vocab_size=16, ninp=8, nhead=2, nhid=16, nlayers=1)  # its layers, a test's size
    path = start_checkpoint(model, tmp_path / "start.ckpt")
    g = torch.Generator().manual_seed(1)
    example = (torch.randint(0, 16, (2, 5), generator=g), torch.randint(0, 16, (2, 5), generator=g))
    art = make_training_artifacts(model, path, tmp_path / "art", example_input=example)
    training = onnx.load(art.training_model)
    batch = {i.name: i.type.tensor_type.shape.dim[0].dim_param for i in training.graph.input}
    assert batch["input0"] == batch["input1"] == "batch"
    inputs, target = torch.randint(0, 16, (3, 5), generator=g), torch.randint(0, 16, (3, 5), generator=g)
    labels = target.reshape(-1)
    state = api.CheckpointState.load_checkpoint(art.checkpoint)
    module = api.Module(art.training_model, state, art.eval_model)
    module.eval()
    assert module.input_names() == ["input0", "input1", "labels"]
    ort_loss = float(module(inputs.numpy(), target.numpy(), labels.numpy()))
    with torch.no_grad():
        torch_loss = nn.functional.cross_entropy(model.eval()(inputs, target), labels).item()
    assert abs(ort_loss - torch_loss) < 1e-5
    optimizer = api.Optimizer(art.optimizer_model, module)
    before = dict(state.parameters)["model.decoder.weight"].data.copy()
    module.train()
    module(inputs.numpy(), target.numpy(), labels.numpy())
    optimizer.step()
    assert not np.array_equal(dict(state.parameters)["model.decoder.weight"].data, before)


class Seq2SeqLogits(nn.Module):
    """(batch, positions, classes) logits: ORT's cross-entropy reads the classes on axis 1."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def test_a_model_ort_cannot_train_is_an_artifacts_error_not_a_crash_later(tmp_path: Any) -> None:
    model = Seq2SeqLogits()
    path = start_checkpoint(model, tmp_path / "start.ckpt")
    with pytest.raises(ArtifactsError) as info:
        make_training_artifacts(model, path, tmp_path / "art", example_input=torch.randint(0, 10, (2, 5)))
    message = str(info.value)
    assert message.startswith(f"{path}: ONNX Runtime could not run a training step of the artifacts on the example "
                              "input: node ") and "(SoftmaxCrossEntropyLoss) failed" in message
    assert "flatten the output" in message and "\n" not in message
    assert not os.path.exists(tmp_path / "art" / "training_model.onnx")
