"""On-device training artifacts: what ONNX Runtime's ``Module`` and ``Optimizer`` need to keep training a checkpoint.

:func:`make_training_artifacts` exports your module, runs ORT's ``generate_artifacts`` (training, eval and AdamW
optimizer models) and writes the checkpoint as the starting state, with parameter names equal to the ``state_dict``
keys. The trainable set is the checkpoint's (for an ORT file: its ``requires_grad`` parameters, which
``OrtCheckpointIO`` chose as those the first optimizer trains; see ``translation.lightning.trainable_set``), so
ORT's ``Optimizer`` finds state for each. Four things ORT 1.19.2 needs handled:

- The module is exported in training mode, so the training model keeps Dropout and BatchNorm's batch statistics
  (exporting in eval mode drops Dropout and can merge BatchNorm initializers of equal value, losing their names).
  Tracing runs one forward pass, which moves BatchNorm's running statistics: it runs on a copy, and the
  initializers get the checkpoint's values back.
- ``generate_artifacts`` then gives an eval model whose BatchNormalization nodes keep their training outputs, which
  ORT refuses ("This number of op outputs should be 1 when Training_mode = False"); the eval model is repaired:
  BatchNormalization and Dropout in inference form.
- ORT's gradients of LayerNormalization and Dropout read their optional outputs (mean and inverse standard
  deviation; the mask), which ``torch.onnx.export`` leaves out: they are added, so transformer blocks (LayerNorm at
  opset 17, attention with dropout) train. InstanceNormalization (GroupNorm, InstanceNorm), which ORT cannot
  differentiate, is written out as the ops it stands for. Any other operator ORT has no gradient for raises
  :class:`ArtifactsError` naming it.
- onnx >= 1.17 stamps an IR version ORT 1.19.2 rejects on the models; it is clamped to 10.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CheckpointError
from .format import load_checkpoint, save_checkpoint
from ._reading import is_ort_checkpoint, read_any_checkpoint, serving
from ._translation.lightning_dict import ModuleInfo, to_ort, trainable_set, with_aliases

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
    narrow = {n: p.dtype for n, p in module.named_parameters() if p.is_floating_point() and p.element_size() < 4}
    if narrow:
        name, dtype = next(iter(narrow.items()))
        raise ArtifactsError(f"ONNX Runtime 1.19.2 trains float32 graphs, and parameter {name!r} is "
                             f"{str(dtype).removeprefix('torch.')} ({len(narrow)} such parameters): pass a float32 "
                             f"module instance as model (YourModule.load_from_checkpoint(path).float()); a "
                             f"checkpoint saved with ort_compatible=True already holds them as float32", checkpoint)
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
    _expose_gradient_outputs(graph)
    _decompose_instance_norm(graph)
    names = {i.name for i in graph.graph.initializer}
    in_file = set(load_checkpoint(checkpoint).trainable) if is_ort_checkpoint(checkpoint) else None
    trainable = [n for n, p in module.named_parameters()
                 if n in (in_file if in_file is not None else trainable_set(module, None))]
    renamed = [n for n in trainable if n not in names]
    if renamed:
        raise ArtifactsError(f"the ONNX export renamed or folded parameters {renamed[:5]}; ORT could not match them "
                             "to the checkpoint", checkpoint)
    frozen = [n for n in values if n in names and n not in trainable]  # num_batches_tracked is no initializer
    try:
        with _quiet_native_logs():
            artifacts.generate_artifacts(graph, requires_grad=trainable, frozen_params=frozen,
                                         loss=loss if loss is not None else artifacts.LossType.CrossEntropyLoss,
                                         optimizer=optimizer if optimizer is not None else artifacts.OptimType.AdamW,
                                         artifact_directory=directory)
    except RuntimeError as e:
        raise _gradient_error(e, checkpoint) from e
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
        with serving(checkpoint, state):  # what was read: the file is not read again
            return model.load_from_checkpoint(checkpoint, map_location="cpu")
    model.load_state_dict(with_aliases(state["state_dict"], model))
    return model


def _expose_gradient_outputs(graph: Any) -> None:
    """Give LayerNormalization (mean, inverse std) and Dropout (mask) the optional outputs ORT's gradients read."""
    wanted = {"LayerNormalization": 3, "Dropout": 2}
    for index, node in enumerate(graph.graph.node):
        count = wanted.get(node.op_type, 0)
        while len(node.output) < count:
            node.output.append(f"{node.output[0]}.grad_input{len(node.output)}.{index}")


def _decompose_instance_norm(graph: Any) -> None:
    """InstanceNormalization (what GroupNorm and InstanceNorm export to; ORT has no gradient for it) as the
    elementwise and ReduceMean ops it stands for, which ORT differentiates: ``scale * (x - mean) / sqrt(var + eps) +
    bias`` over the spatial axes, with the biased variance, as the operator defines."""
    import onnx
    from onnx import helper

    opset = next((o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13 or not any(n.op_type == "InstanceNormalization" for n in graph.graph.node):
        return  # before opset 13 Unsqueeze takes attributes: left as it is (ArtifactsError names it)
    inferred = onnx.shape_inference.infer_shapes(graph)
    ranks = {v.name: len(v.type.tensor_type.shape.dim)
             for v in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)
             if v.type.tensor_type.HasField("shape")}
    nodes = []
    for index, node in enumerate(graph.graph.node):
        rank = ranks.get(node.input[0]) if node.op_type == "InstanceNormalization" else None
        if rank is None or rank < 3:
            nodes.append(node)
            continue
        x, scale, bias = node.input
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        p = f"{node.output[0]}.instance_norm{index}."
        axes = list(range(2, rank))

        def mean(source: str, target: str) -> list[Any]:  # opset 18 moved ReduceMean's axes to an input
            if opset < 18:
                return [helper.make_node("ReduceMean", [source], [target], axes=axes, keepdims=1)]
            constant = helper.make_tensor(target + ".axes", onnx.TensorProto.INT64, [len(axes)], axes)
            return [helper.make_node("Constant", [], [target + ".axes"], value=constant),
                    helper.make_node("ReduceMean", [source, target + ".axes"], [target], keepdims=1)]

        nodes += [
            *mean(x, p + "mean"),
            helper.make_node("Sub", [x, p + "mean"], [p + "centered"]),
            helper.make_node("Mul", [p + "centered", p + "centered"], [p + "squared"]),
            *mean(p + "squared", p + "var"),
            helper.make_node("Constant", [], [p + "eps"], value=helper.make_tensor(p + "eps", 1, [], [eps])),
            helper.make_node("Add", [p + "var", p + "eps"], [p + "var_eps"]),
            helper.make_node("Sqrt", [p + "var_eps"], [p + "std"]),
            helper.make_node("Div", [p + "centered", p + "std"], [p + "normed"]),
            helper.make_node("Constant", [], [p + "axes"],
                             value=helper.make_tensor(p + "axes", onnx.TensorProto.INT64, [rank - 2],
                                                      list(range(1, rank - 1)))),
            helper.make_node("Unsqueeze", [scale, p + "axes"], [p + "scale"]),
            helper.make_node("Unsqueeze", [bias, p + "axes"], [p + "bias"]),
            helper.make_node("Mul", [p + "normed", p + "scale"], [p + "scaled"]),
            helper.make_node("Add", [p + "scaled", p + "bias"], [node.output[0]]),
        ]
    del graph.graph.node[:]
    graph.graph.node.extend(nodes)


_NO_GRADIENT = re.compile(r"gradient builder has not been registered: (\S+) for node (\S+)")


def _gradient_error(error: RuntimeError, checkpoint: str) -> ArtifactsError:
    """ORT's gradient builder failure in the user's terms: the operator, and what to do about it."""
    found = _NO_GRADIENT.search(str(error))
    if found:
        op, node = found.groups()
        return ArtifactsError(
            f"ONNX Runtime's training cannot differentiate the ONNX operator {op} (node {node}); replace the torch "
            f"operation that exports to it with a differentiable one, or set requires_grad=False on the parameters "
            f"before it so no gradient has to pass through it", checkpoint)
    return ArtifactsError(f"ONNX Runtime could not build the training graph: {str(error).strip()[-300:]}",
                          checkpoint)


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
    save_checkpoint(to_ort(state, ModuleInfo(trainable_set(module, None), params)), path)


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
