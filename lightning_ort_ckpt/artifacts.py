"""On-device training artifacts: what ONNX Runtime's ``Module`` and ``Optimizer`` need to keep training a checkpoint.

:func:`make_training_artifacts` exports your module, runs ORT's ``generate_artifacts`` (training, eval and AdamW
optimizer models) and writes the checkpoint as the starting state, with parameter names equal to the ``state_dict``
keys. Three things ORT 1.19.2 needs handled:

- The module is exported in training mode, so the training model keeps Dropout and BatchNorm's batch statistics
  (exporting in eval mode drops Dropout and can merge BatchNorm initializers of equal value, losing their names).
  Tracing runs one forward pass, which moves BatchNorm's running statistics: it runs on a copy, and the
  initializers get the checkpoint's values back.
- ``generate_artifacts`` then gives an eval model whose BatchNormalization nodes keep their training outputs, which
  ORT refuses ("This number of op outputs should be 1 when Training_mode = False"); the eval model is repaired:
  BatchNormalization and Dropout in inference form.
- onnx >= 1.17 stamps an IR version ORT 1.19.2 rejects on the models; it is clamped to 10.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CheckpointError
from .format import load_checkpoint, save_checkpoint
from .plugin import is_ort_checkpoint, read_any_checkpoint
from .translation.lightning import ModuleInfo, to_ort

ORT_MAX_IR_VERSION = 10  # onnxruntime-training 1.19.2


class ArtifactsError(CheckpointError):
    """The training artifacts could not be made for this module."""


@dataclass(frozen=True)
class TrainingArtifacts:
    """Paths for ``onnxruntime.training.api``: ``CheckpointState.load_checkpoint(checkpoint)``, then
    ``Module(training_model, state, eval_model)`` and ``Optimizer(optimizer_model, module)``."""

    directory: str
    training_model: str
    eval_model: str
    optimizer_model: str
    checkpoint: str
    trainable: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)


def make_training_artifacts(model: Any, checkpoint: str | os.PathLike[str], directory: str | os.PathLike[str], *,
                            example_input: Any = None, loss: Any = None, optimizer: Any = None,
                            opset: int = 17) -> TrainingArtifacts:
    """Training artifacts for ``model`` starting from ``checkpoint``.

    Args:
        model: your LightningModule class (built with ``load_from_checkpoint``) or a module instance.
        checkpoint: an ORT or torch checkpoint; its weights (and AdamW moments, if any) are the starting state.
        example_input: a batch of model inputs; defaults to the module's ``example_input_array``.
        loss: an ``onnxruntime.training.artifacts.LossType`` or onnxblock loss; default cross-entropy.
        optimizer: an ``artifacts.OptimType`` or onnxblock optimizer; default AdamW (ORT's betas 0.9/0.999,
            eps 1e-6, no weight decay: set the learning rate with ``Optimizer.set_learning_rate``).
    """
    import onnx
    from onnxruntime.training import artifacts

    checkpoint, directory = os.fspath(checkpoint), os.fspath(directory)
    state = read_any_checkpoint(checkpoint)
    module = _load_module(model, checkpoint, state)
    args = example_input if example_input is not None else getattr(module, "example_input_array", None)
    if args is None:
        raise ArtifactsError("no example input: pass example_input or set example_input_array on the module",
                             checkpoint)
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, "base_model.onnx")
    values = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    _export_training_graph(module, args, base, opset)
    graph = onnx.load(base)
    for init in graph.graph.initializer:  # the traced forward pass moved BatchNorm statistics: put them back
        if init.name in values:
            init.CopyFrom(onnx.numpy_helper.from_array(values[init.name].numpy(), init.name))
    names = {i.name for i in graph.graph.initializer}
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    renamed = [n for n in trainable if n not in names]
    if renamed:
        raise ArtifactsError(f"the ONNX export renamed or folded parameters {renamed[:5]}; ORT could not match them "
                             "to the checkpoint", checkpoint)
    frozen = [n for n in values if n in names and n not in trainable]  # num_batches_tracked is no initializer
    with _quiet_native_logs():
        artifacts.generate_artifacts(graph, requires_grad=trainable, frozen_params=frozen,
                                     loss=loss if loss is not None else artifacts.LossType.CrossEntropyLoss,
                                     optimizer=optimizer if optimizer is not None else artifacts.OptimType.AdamW,
                                     artifact_directory=directory)
    out = TrainingArtifacts(directory, *(os.path.join(directory, f) for f in
                                         ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx",
                                          "checkpoint")), trainable, frozen)
    _repair_eval_model(out.eval_model)
    for path in (out.training_model, out.eval_model, out.optimizer_model):
        _clamp_ir_version(path)
    _write_starting_state(checkpoint, state, module, out.checkpoint)
    return out


def _load_module(model: Any, checkpoint: str, state: dict[str, Any]) -> torch.nn.Module:
    if isinstance(model, type):
        return model.load_from_checkpoint(checkpoint, map_location="cpu")
    model.load_state_dict(state["state_dict"])
    return model


def _export_training_graph(module: torch.nn.Module, args: Any, path: str, opset: int) -> None:
    """Export a copy in training mode (Dropout and BatchNorm batch statistics stay in the graph)."""
    copy_ = copy.deepcopy(module).cpu().train()
    args = args if isinstance(args, tuple) else (args,)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export")
            warnings.filterwarnings("ignore", message=".*Removing mutation from node")
            torch.onnx.export(copy_, tuple(a.cpu() for a in args), path, input_names=["input"],
                              output_names=["output"], dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
                              opset_version=opset, training=torch.onnx.TrainingMode.TRAINING,
                              do_constant_folding=False, export_params=True, dynamo=False)
    except Exception as e:  # noqa: BLE001 - the exporter raises many types; the user needs the message
        raise ArtifactsError(f"torch.onnx.export failed: {type(e).__name__}: {e}") from e


def _repair_eval_model(path: str) -> None:
    """BatchNormalization with one output and training_mode=0, Dropout without its training input: inference form."""
    import onnx

    model = onnx.load(path)
    dropped: set[str] = set()
    for node in model.graph.node:
        if node.op_type in ("BatchNormalization", "Dropout"):
            dropped.update(o for o in node.output[1:] if o)
            del node.output[1:]
            if node.op_type == "Dropout":
                del node.input[2:]  # no training_mode input: inference, an identity
            for attr in node.attribute:
                if attr.name == "training_mode":
                    attr.i = 0
    still_used = dropped & {i for n in model.graph.node for i in n.input}
    if still_used:
        raise ArtifactsError(f"the eval model uses BatchNorm/Dropout training outputs {sorted(still_used)}")
    for repeated in (model.graph.output, model.graph.value_info):
        kept = [v for v in repeated if v.name not in dropped]
        del repeated[:]
        repeated.extend(kept)
    onnx.save(model, path)


def _clamp_ir_version(path: str) -> None:
    import onnx

    model = onnx.load(path)
    if model.ir_version > ORT_MAX_IR_VERSION:
        model.ir_version = ORT_MAX_IR_VERSION
        onnx.save(model, path)


def _write_starting_state(source: str, state: dict[str, Any], module: torch.nn.Module, path: str) -> None:
    """The checkpoint itself as ORT's starting state (an ORT file is copied as it is, a torch file translated)."""
    if is_ort_checkpoint(source):
        save_checkpoint(load_checkpoint(source), path)
        return
    # a torch file: a first optimizer over all parameters indexes them in module.parameters() order (the usual
    # `Adam(self.parameters())`); other optimizers keep their state under index names
    names = [n for n, _ in module.named_parameters()]
    params = [names if i == 0 and sum(len(g["params"]) for g in opt["param_groups"]) == len(names) else [""]
              for i, opt in enumerate(state.get("optimizer_states", []))]
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    save_checkpoint(to_ort(state, ModuleInfo(trainable, params)), path)


@contextlib.contextmanager
def _quiet_native_logs() -> Any:
    """generate_artifacts logs every graph pass at info level from C++ (fd 2); keep it out of the user's output."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
