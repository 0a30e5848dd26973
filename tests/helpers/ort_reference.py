"""Helpers shared by the tests: exact byte comparison of tensors and reference files made by the real ORT.

Importing this module does not import onnxruntime; :func:`ort_api` does (and quiets its logger).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# -- exact comparison -------------------------------------------------------------------------------------------


def raw_bytes(x: Any) -> bytes:
    """The elements of a torch tensor or numpy array as little-endian bytes in C order."""
    if isinstance(x, torch.Tensor):
        t = x.detach().resolve_conj().resolve_neg().cpu().contiguous()
        return t.reshape(-1).view(torch.uint8).numpy().tobytes()
    a = np.asarray(x)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.ascontiguousarray(a).tobytes()


def assert_same_tensor(actual: Any, expected: Any, what: str = "") -> None:
    """Same shape, same dtype (torch dtype when both are torch tensors) and bitwise-identical bytes."""
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)} != {expected.shape}"
    if isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert raw_bytes(actual) == raw_bytes(expected), f"{what}: bytes differ"


def assert_same_checkpoint(actual: Any, expected: Any) -> None:
    """Two in-memory Checkpoints hold the same names, bitwise-identical tensors, scalars and properties."""
    assert actual.trainable.keys() == expected.trainable.keys() and actual.frozen.keys() == expected.frozen.keys()
    for kind in ("trainable", "frozen"):
        for name, tensor in getattr(expected, kind).items():
            assert_same_tensor(getattr(actual, kind)[name], tensor, name)
    assert actual.optimizer_groups.keys() == expected.optimizer_groups.keys()
    for group_name, ge in expected.optimizer_groups.items():
        ga = actual.optimizer_groups[group_name]
        assert (ga.step, ga.initial_learning_rate) == (ge.step, ge.initial_learning_rate), group_name
        assert ga.states.keys() == ge.states.keys(), group_name
        for param, momentums in ge.states.items():
            assert ga.states[param].keys() == momentums.keys(), param
            for m, tensor in momentums.items():
                assert_same_tensor(ga.states[param][m], tensor, f"{group_name}/{param}/{m}")
    assert actual.properties == expected.properties
    assert actual.nominal == expected.nominal


def file_bytes(path: str | os.PathLike[str]) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# -- ORT ----------------------------------------------------------------------------------------------------------


def ort_api() -> Any:
    """``onnxruntime.training.api`` with ORT's logger quieted."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    from onnxruntime.training import api

    return api


class SmallNet(torch.nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear, with an int64 index buffer: float params, float and int64 buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.fc2 = torch.nn.Linear(6, 3)
        self.register_buffer("offset_idx", torch.tensor([2, 0, 1], dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.fc1(x)))
        return torch.index_select(self.fc2(h), 1, self.offset_idx)


@dataclass
class Artifacts:
    """Training artifacts made by ``onnxruntime.training.artifacts.generate_artifacts`` for :class:`SmallNet`."""

    directory: str
    model: SmallNet
    requires_grad: list[str]
    frozen: list[str]
    initializer_order: list[str] = field(default_factory=list)
    initializers: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def checkpoint(self) -> str:
        return os.path.join(self.directory, "checkpoint")

    @property
    def nominal_checkpoint(self) -> str:
        return os.path.join(self.directory, "nominal_checkpoint")

    @property
    def training_model(self) -> str:
        return os.path.join(self.directory, "training_model.onnx")

    @property
    def eval_model(self) -> str:
        return os.path.join(self.directory, "eval_model.onnx")

    @property
    def optimizer_model(self) -> str:
        return os.path.join(self.directory, "optimizer_model.onnx")


def clamp_ir_version(directory: str) -> None:
    """onnx >= 1.17 stamps IR version > 10 on the optimizer model; ORT 1.19.2 accepts at most 10."""
    import onnx

    for name in ("optimizer_model.onnx", "training_model.onnx", "eval_model.onnx"):
        path = os.path.join(directory, name)
        model = onnx.load(path)
        if model.ir_version > 10:
            model.ir_version = 9
            onnx.save(model, path)


def make_artifacts(directory: str, optimizer: str = "AdamW", seed: int = 0) -> Artifacts:
    """Export :class:`SmallNet` (dynamo=False, training=EVAL, no constant folding) and generate ORT artifacts.

    Every torch parameter is trainable; the buffers that are graph initializers are frozen. A nominal checkpoint is
    written too.
    """
    import onnx
    from onnx import numpy_helper

    ort_api()
    from onnxruntime.training import artifacts

    torch.manual_seed(seed)
    model = SmallNet()
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.arange(6, dtype=torch.float32) * 0.1)
        model.bn.running_var.copy_(torch.ones(6) + torch.arange(6) * 0.05)
    model.eval()
    os.makedirs(directory, exist_ok=True)
    onnx_path = os.path.join(directory, "base.onnx")
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notices
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (torch.randn(2, 4),), onnx_path, input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, do_constant_folding=False,
                          export_params=True, dynamo=False, training=torch.onnx.TrainingMode.EVAL, opset_version=17)
    proto = onnx.load(onnx_path)
    order = [i.name for i in proto.graph.initializer]
    requires_grad = [n for n, _ in model.named_parameters()]
    frozen = [n for n, _ in model.named_buffers() if n in order]
    assert set(requires_grad) <= set(order), (requires_grad, order)
    artifacts.generate_artifacts(proto, requires_grad=requires_grad, frozen_params=frozen,
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=getattr(artifacts.OptimType, optimizer), artifact_directory=directory,
                                 nominal_checkpoint=True)
    clamp_ir_version(directory)
    return Artifacts(directory, model, requires_grad, frozen, order,
                     {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer})


def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and class labels for :class:`SmallNet` with cross-entropy loss."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((5, 4)).astype(np.float32), np.array([0, 1, 2, 1, 0], dtype=np.int64)


def ort_properties(state: Any) -> dict[str, Any]:
    """The property bag of an ORT ``CheckpointState`` as a dict."""
    return dict(iter(state.properties))


def ort_parameters(state: Any) -> dict[str, tuple[np.ndarray, bool]]:
    """name -> (data copy, requires_grad) of an ORT ``CheckpointState``."""
    return {name: (p.data.copy(), p.requires_grad) for name, p in state.parameters}


# -- artifacts for any torch module, and ORT training ----------------------------------------------------------------


def export_artifacts(model: torch.nn.Module, directory: str, example_input: torch.Tensor,
                     optimizer: str = "AdamW") -> Artifacts:
    """Training artifacts for any ``model`` (a LightningModule too) with a cross-entropy loss on its output.

    Exported like :func:`make_artifacts` (dynamo=False, training=EVAL, no constant folding, parameters exported), so
    the initializer names are the ``state_dict`` keys: the ``requires_grad`` parameters are trainable, the buffers
    that became initializers are frozen. ``generate_artifacts`` also writes its own ``checkpoint``. The module's
    train/eval mode is left as it was.
    """
    import onnx
    from onnx import numpy_helper

    ort_api()
    from onnxruntime.training import artifacts

    os.makedirs(directory, exist_ok=True)
    onnx_path = os.path.join(directory, "base.onnx")
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notices
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example_input,), onnx_path, input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, do_constant_folding=False,
                          export_params=True, dynamo=False, training=torch.onnx.TrainingMode.EVAL, opset_version=17)
    proto = onnx.load(onnx_path)
    order = [i.name for i in proto.graph.initializer]
    requires_grad = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = [n for n, _ in model.named_buffers() if n in order]
    frozen += [n for n, p in model.named_parameters() if not p.requires_grad and n in order]
    assert set(requires_grad) <= set(order), (requires_grad, order)
    artifacts.generate_artifacts(proto, requires_grad=requires_grad, frozen_params=frozen,
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=getattr(artifacts.OptimType, optimizer), artifact_directory=directory)
    clamp_ir_version(directory)
    return Artifacts(directory, model, requires_grad, frozen, order,  # type: ignore[arg-type]
                     {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer})


def ort_train(art: Artifacts, state: Any, batches: list[tuple[np.ndarray, np.ndarray]],
              lr: float | None = None) -> list[float]:
    """Train with ORT's ``Module`` + ``Optimizer`` from ``state``, one optimizer step per batch; the losses.

    ``lr`` goes to ``Optimizer.set_learning_rate`` (ORT does not take it from the checkpoint).
    """
    api = ort_api()
    module = api.Module(art.training_model, state, art.eval_model)
    opt = api.Optimizer(art.optimizer_model, module)
    if lr is not None:
        opt.set_learning_rate(lr)
    module.train()
    losses = []
    for x, y in batches:
        losses.append(float(module(x, y)))
        opt.step()
        module.lazy_reset_grad()
    return losses
