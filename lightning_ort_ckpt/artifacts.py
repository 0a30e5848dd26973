"""On-device training artifacts: what ONNX Runtime's ``Module`` and ``Optimizer`` need to keep training a checkpoint.

:func:`make_training_artifacts` exports your module, runs ORT's ``generate_artifacts`` (training, eval and AdamW
optimizer models) and writes the checkpoint as the starting state, with parameter names equal to the ``state_dict``
keys. The trainable set is the checkpoint's (for an ORT file: its ``requires_grad`` parameters, which
``OrtCheckpointIO`` chose as those the first optimizer trains; see ``_translation.lightning_dict.trainable_set``), so
ORT's ``Optimizer`` finds state for each. What ORT 1.19.2 needs handled:

- The training model is exported in training mode, so it keeps Dropout and BatchNorm's batch statistics
  (exporting in eval mode drops Dropout and can merge BatchNorm initializers of equal value, losing their names).
  Tracing runs one forward pass, which moves BatchNorm's running statistics: it runs on a copy, and the
  initializers get the checkpoint's values back. Every input has a dynamic batch dimension.
- ``generate_artifacts`` derives the eval model from that training graph, so a random op a module draws only in
  training (stochastic depth and DropPath: ``torch.rand`` masks) stays in it. The eval model's forward is replaced
  by an eval-mode export that keeps every parameter under its name (what torch's ``eval()`` computes; BatchNorm and
  Dropout in inference form), followed by the same loss; a random op left there (a forward that is random in eval
  mode) raises :class:`ArtifactsError`.
- ORT's gradients of LayerNormalization and Dropout read their optional outputs (mean and inverse standard
  deviation; the mask), which ``torch.onnx.export`` leaves out: they are added, so transformer blocks (LayerNorm at
  opset 17, attention with dropout) train. InstanceNormalization (GroupNorm, InstanceNorm), which ORT cannot
  differentiate, is written out as the ops it stands for. Any other operator ORT has no gradient for raises
  :class:`ArtifactsError` naming it.
- onnx >= 1.17 stamps an IR version ORT 1.19.2 rejects on the models; it is clamped to 10.

Before the artifacts are returned, ORT runs one training step, one optimizer step and one eval step on the example
input, in memory: a model ORT cannot train fails then, as an :class:`ArtifactsError`, and leaves no artifacts.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CheckpointError
from .export import default_names, hidden_native_output, torch_export
from .format import load_checkpoint, save_checkpoint
from ._export._module_loading import load_module
from ._restore._reading import is_ort_checkpoint, read_any_checkpoint
from ._translation.lightning_dict import ModuleInfo, to_ort, trainable_set

__all__ = ["ArtifactsError", "TrainingArtifacts", "make_training_artifacts"]

ORT_MAX_IR_VERSION = 10  # onnxruntime-training 1.19.2
# ops that draw random numbers (Dropout only with its training_mode input set: see _random_nodes)
_RANDOM_OPS = frozenset({"RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Bernoulli",
                         "Multinomial", "Dropout"})
_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")


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
                            opset: int = 17, verbose: bool = False) -> TrainingArtifacts:
    """Training artifacts for ``model`` starting from ``checkpoint``, tried with one ORT training step.

    Args:
        model: your LightningModule class (built with ``load_from_checkpoint``) or a module instance.
        checkpoint: an ORT or torch checkpoint, or a sharded checkpoint directory; its weights (and AdamW moments, if any) are the starting state.
        example_input: a batch of model inputs (a tuple for several, named ``input0``, ``input1``...); defaults to
            the module's ``example_input_array``.
        loss: an ``onnxruntime.training.artifacts.LossType`` or onnxblock loss; default cross-entropy.
        optimizer: an ``artifacts.OptimType`` or onnxblock optimizer; default AdamW (ORT's betas 0.9/0.999,
            eps 1e-6, no weight decay: set the learning rate with ``Optimizer.set_learning_rate``).
        verbose: let ``torch.onnx.export``'s own output through and give its whole message in errors.
    Raises:
        ArtifactsError: the module cannot be exported, ORT cannot differentiate or run it (checked with a training
            step on the example input), or its eval-mode forward is random.
    """
    from ._export._consolidate import single_file

    with single_file(os.fspath(checkpoint)) as source:  # a sharded directory: consolidated into a temporary file
        return _make_training_artifacts(model, source, directory, example_input=example_input, loss=loss,
                                        optimizer=optimizer, opset=opset, verbose=verbose)


def _make_training_artifacts(model: Any, checkpoint: str, directory: str | os.PathLike[str], *, example_input: Any,
                             loss: Any, optimizer: Any, opset: int, verbose: bool) -> TrainingArtifacts:
    import onnx
    from onnxruntime.training import artifacts

    checkpoint, directory = os.fspath(checkpoint), os.fspath(directory)
    state = read_any_checkpoint(checkpoint)
    module = load_module(model, checkpoint, state, ArtifactsError)
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
    args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in (args if isinstance(args, tuple) else (args,)))
    input_names = default_names("input", len(args))
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, "base_model.onnx")
    values = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    copy_ = copy.deepcopy(module).cpu()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first = copy_.eval()(*args)
    except Exception as e:  # noqa: BLE001 - the user's forward may raise anything
        raise ArtifactsError(f"the module's forward failed on the example input: {type(e).__name__}: {e}",
                             checkpoint) from e
    output_shape = tuple((first[0] if isinstance(first, (tuple, list)) else first).shape)
    eval_forward = _export_eval_forward(copy_, args, directory, opset, input_names, verbose, checkpoint)
    torch_export(copy_.train(), args, base, opset=opset, input_names=input_names, output_names=["output"],
                 mode="train", verbose=verbose, checkpoint=checkpoint, error=ArtifactsError)
    del copy_
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
        with hidden_native_output(2):  # generate_artifacts logs every graph pass at info level from C++
            artifacts.generate_artifacts(graph, requires_grad=trainable, frozen_params=frozen,
                                         loss=loss if loss is not None else artifacts.LossType.CrossEntropyLoss,
                                         optimizer=optimizer if optimizer is not None else artifacts.OptimType.AdamW,
                                         artifact_directory=directory)
    except RuntimeError as e:
        raise _gradient_error(e, checkpoint) from e
    training, evaluation, optimizer_model, start = (os.path.join(directory, f) for f in _FILES)
    out = TrainingArtifacts(directory, training, evaluation, optimizer_model, start, trainable, frozen)
    try:
        _replace_eval_forward(out.eval_model, eval_forward, len(graph.graph.node), checkpoint)
        for path in (out.training_model, out.eval_model, out.optimizer_model):
            _clamp_ir_version(path)
        _write_starting_state(checkpoint, state, module, out.checkpoint)
        _trial_step(out, args, output_shape, checkpoint)
    except BaseException:
        for path in (out.training_model, out.eval_model, out.optimizer_model, out.checkpoint):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        raise
    return out


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


def _export_eval_forward(module: torch.nn.Module, args: tuple[Any, ...], directory: str, opset: int,
                         input_names: list[str], verbose: bool, checkpoint: str) -> Any:
    """The eval-mode export of ``module`` (every parameter an initializer under its ``state_dict`` name)."""
    import onnx

    with tempfile.TemporaryDirectory(dir=directory, prefix=".eval-export-") as work:
        path = os.path.join(work, "eval_forward.onnx")
        torch_export(module, args, path, opset=opset, input_names=input_names, output_names=["output"],
                     mode="eval", verbose=verbose, checkpoint=checkpoint, error=ArtifactsError)
        return onnx.load(path)


def _replace_eval_forward(path: str, forward: Any, forward_nodes: int, checkpoint: str) -> None:
    """The eval model ``generate_artifacts`` wrote at ``path`` is its training graph's first ``forward_nodes``
    nodes (inference form) followed by the loss: keep its loss, inputs (user inputs, labels, then the parameters in
    the order ORT's ``Module`` feeds them) and outputs; take the forward from the eval-mode export ``forward``."""
    import onnx

    model = onnx.load(path)
    graph = model.graph
    loss_nodes = list(graph.node[forward_nodes:])
    inputs = {i.name for i in graph.input}
    used = {name for node in loss_nodes for name in node.input}
    initializers = ([i for i in forward.graph.initializer if i.name not in inputs]
                    + [i for i in graph.initializer if i.name in used])
    del graph.node[:], graph.initializer[:], graph.value_info[:]
    graph.node.extend([*forward.graph.node, *loss_nodes])
    graph.initializer.extend(initializers)
    domains = {o.domain for o in model.opset_import}
    model.opset_import.extend(o for o in forward.opset_import if o.domain not in domains)
    random = _random_nodes(graph)
    if random:
        raise ArtifactsError(
            f"the module's forward is random in eval mode ({', '.join(random[:3])} in its eval-mode export), so ORT's "
            f"eval model would give another answer each time: draw random numbers only when self.training is True "
            f"(as nn.Dropout and stochastic depth do)", checkpoint)
    onnx.save(model, path)


def _random_nodes(graph: Any) -> list[str]:
    """``"op (node name)"`` of every node that draws random numbers, subgraphs included; Dropout counts when its
    training_mode input is given."""
    found = []
    for node in graph.node:
        if node.op_type in _RANDOM_OPS and (node.op_type != "Dropout" or (len(node.input) > 2 and node.input[2])):
            found.append(f"{node.op_type} ({node.name or node.output[0]})")
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                found += _random_nodes(sub)
    return found


def _trial_step(out: TrainingArtifacts, args: tuple[Any, ...], output_shape: tuple[int, ...],
                checkpoint: str) -> None:
    """One training step, one optimizer step and one eval step of ORT on the example input, in memory (the files
    are not changed), so that a model ORT cannot train fails here, not in the user's training loop. The loss's
    other inputs (labels) are zeros of the shape and type the loss wants, their batch dimensions the output's."""
    import onnx
    import onnxruntime
    from onnxruntime.training import api

    declared = {i.name: i.type.tensor_type for i in onnx.load(out.eval_model, load_external_data=False).graph.input}
    given = dict(zip(default_names("input", len(args)), args))
    onnxruntime.set_default_logger_severity(3)
    try:
        with hidden_native_output(2):
            state = api.CheckpointState.load_checkpoint(out.checkpoint)
            module = api.Module(out.training_model, state, out.eval_model)
            optimizer = api.Optimizer(out.optimizer_model, module)
            for training in (True, False):
                module.train(training)
                feeds = [given[name].numpy() if name in given else _zeros_like(declared[name], output_shape)
                         for name in module.input_names()]
                module(*feeds)
                if training:
                    optimizer.step()
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types (Fail, InvalidArgument, ...)
        raise _step_error(e, checkpoint) from e


_FAILED_NODE = re.compile(r"while running (\S+) node\. Name:'([^']*)' Status Message: (.*)", re.S)


def _step_error(error: Exception, checkpoint: str) -> ArtifactsError:
    """ORT's failure of the trial step in the user's terms: the node, what it said, and what to do about it."""
    text = str(error).strip()
    found = _FAILED_NODE.search(text)
    if not found:
        return ArtifactsError(f"ONNX Runtime could not run a training step of the artifacts on the example input: "
                              f"{text.splitlines()[0] if text else type(error).__name__}", checkpoint)
    op, node, message = found.groups()
    message = re.sub(r"^/\S+:\d+ .*?\) ", "", message.strip().splitlines()[0])  # the C++ source location
    if op == "SoftmaxCrossEntropyLoss":
        hint = ("ORT's cross-entropy takes logits (batch, classes) or (batch, classes, d1, ...): flatten the "
                "output to (batch * positions, classes) as Lightning's demo Transformer does, or pass another loss")
    elif "_Grad/" in node:
        hint = ("this is a limit of onnxruntime-training 1.19.2's gradient graph for the torch operation at "
                f"{node.split('_Grad/')[0]}: replace that operation, or set requires_grad=False on the parameters "
                "before it so no gradient has to pass through it")
    else:
        hint = "ONNX Runtime cannot run this model as it was exported"
    return ArtifactsError(f"ONNX Runtime could not run a training step of the artifacts on the example input: node "
                          f"{node} ({op}) failed: {message}; {hint}", checkpoint)


def _zeros_like(declared: Any, output_shape: tuple[int, ...]) -> Any:
    import numpy as np
    import onnx

    shape = [d.dim_value if d.HasField("dim_value") else output_shape[i] if i < len(output_shape) else 1
             for i, d in enumerate(declared.shape.dim)]
    return np.zeros(shape, onnx.helper.tensor_dtype_to_np_dtype(declared.elem_type))


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
