"""Deployment export: an ONNX inference model from a checkpoint, checked against ONNX Runtime before it is kept.

:func:`export_onnx` reads a checkpoint's weights (ORT or torch) once, lazily and without the optimizer state, into
your LightningModule, exports it with ``torch.onnx.export``, runs the result in ``onnxruntime.InferenceSession`` on
the example input next to the torch module, and keeps the file only when the largest absolute difference is within
the tolerance. The model's ``metadata_props`` record where it came from: the checkpoint, its global step and its
monitored score.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError
from ._reading import read_weights, serving
from .format import _atomic
from .format._store import is_remote
from ._translation.lightning_dict import with_aliases

_EXTERNAL_DATA_THRESHOLD = 1 << 30  # above 1 GiB of parameters, keep tensors beside the model (protobuf stops at 2)


class ExportError(CheckpointError):
    """The exported model could not be made, or does not give the torch module's answers."""


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_onnx` wrote and how close ONNX Runtime came to torch on the example input."""

    path: str
    checkpoint: str
    global_step: int | None
    monitor: str | None
    score: float | None
    max_abs_diff: float
    tolerance: float
    external_data: bool

    def __str__(self) -> str:
        source = f"{self.checkpoint} (step {self.global_step}"
        source += f", {self.monitor}={self.score:.6g})" if self.monitor and self.score is not None else ")"
        return (f"exported {self.path} from {source}; ONNX Runtime vs torch on the example input: max abs "
                f"difference {self.max_abs_diff:.3g} (tolerance {self.tolerance:g})")


def export_onnx(model: Any, checkpoint: str | os.PathLike[str], output: str | os.PathLike[str], *,
                example_input: Any = None, tolerance: float = 1e-5, opset: int = 17,
                input_names: list[str] | None = None, output_names: list[str] | None = None,
                dynamic_batch: bool = True, external_data: bool | None = None) -> ExportReport:
    """Export ``checkpoint`` loaded into ``model`` to the ONNX file ``output``, verified with ONNX Runtime.

    Args:
        model: your LightningModule class (built with ``load_from_checkpoint``, so hparams come from the file) or a
            module instance (the checkpoint's weights are loaded into it).
        checkpoint: an ORT or torch checkpoint path, or an fsspec URL (read with the store's default configuration,
            e.g. ``AWS_*`` environment variables for S3).
        example_input: the input to export and compare with; defaults to the module's ``example_input_array``.
        tolerance: the largest absolute difference between ONNX Runtime and torch that is accepted.
        external_data: keep the weights in ``<output>.data`` (ONNX external data); by default only past 1 GiB.
    Raises:
        ExportError: no example input, the export failed, or ONNX Runtime differs from torch by more than
            ``tolerance`` (nothing is left at ``output`` then).
    """
    checkpoint, output = os.fspath(checkpoint), os.fspath(output)
    state = read_weights(checkpoint)
    module = _load_module(model, checkpoint, state)
    monitor, score = _monitored_score(state)
    global_step = state.get("global_step")
    del state  # the weights are in the module: the file's pages are let go before the export needs memory
    module.eval()
    args = example_input if example_input is not None else getattr(module, "example_input_array", None)
    if args is None:
        raise ExportError("no example input: pass example_input or set example_input_array on the module",
                          checkpoint)
    args = args if isinstance(args, tuple) else (args,)
    input_names = input_names or ([f"input{i}" for i in range(len(args))] if len(args) > 1 else ["input"])
    try:
        with torch.no_grad():
            expected = module(*args)
    except Exception as e:  # noqa: BLE001 - the user's forward may raise anything
        raise ExportError(f"the module's forward failed on the example input: {type(e).__name__}: {e}",
                          checkpoint) from e
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    output_names = output_names or ([f"output{i}" for i in range(len(expected))] if len(expected) > 1 else ["output"])
    source = checkpoint if is_remote(checkpoint) else os.path.abspath(checkpoint)
    metadata = {"lightning_ort_ckpt.source_checkpoint": source,
                "lightning_ort_ckpt.global_step": "" if global_step is None else str(global_step),
                "lightning_ort_ckpt.monitor": monitor or "", "lightning_ort_ckpt.score": "" if score is None else repr(score)}
    nbytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    external = nbytes > _EXTERNAL_DATA_THRESHOLD if external_data is None else external_data
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".export-") as work:
        staged = os.path.join(work, os.path.basename(output))
        _torch_export(module, args, staged, opset, input_names, output_names, dynamic_batch, work)
        _finish_model(staged, metadata, external)
        diff = _max_abs_diff(staged, args, expected, input_names)
        if not diff <= tolerance:
            raise ExportError(f"ONNX Runtime's output differs from torch's by up to {diff:.3g}, more than the "
                              f"tolerance {tolerance:g}; nothing was written to {output}", checkpoint)
        if external:
            os.replace(_atomic.data_path(staged), _atomic.data_path(output))
        os.replace(staged, output)
    return ExportReport(output, checkpoint, global_step, monitor, score, diff, tolerance, external)


def check_export_config(module: Any, tolerance: Any) -> None:
    """What ``OrtCheckpoint(export_best_to=...)`` checks in ``setup``, so a misconfiguration stops the run before it
    trains, not after: the module class can be rebuilt from a checkpoint (every required ``__init__`` argument is in
    its saved hparams), it has an ``example_input_array``, and ``tolerance`` is a number >= 0."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ExportError(f"export_tolerance must be a number >= 0, got {tolerance!r}")
    cls = type(module)
    required = [p.name for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [name for name in required if name not in getattr(module, "hparams", {})]
    if missing:
        raise ExportError(f"export_best_to rebuilds {cls.__name__} from the best checkpoint, but its __init__ "
                          f"arguments {', '.join(missing)} are not saved: call self.save_hyperparameters() in "
                          f"__init__")
    if getattr(module, "example_input_array", None) is None:
        raise ExportError(f"export_best_to needs an example input: set example_input_array on {cls.__name__}")


def load_module_class(spec: str) -> type:
    """``"package.module:ClassName"`` or ``"path/to/file.py:ClassName"`` -> the class (for the CLI)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ExportError(f"--module wants 'package.module:ClassName' or 'file.py:ClassName', got {spec!r}")
    if where.endswith(".py"):
        found = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        if found is None or found.loader is None or not os.path.exists(where):
            raise ExportError(f"cannot import {where}")
        module = importlib.util.module_from_spec(found)
        sys.modules[found.name] = module  # so that classes pickled by name, and load_from_checkpoint, find it
        found.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current project are importable
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ExportError(f"cannot import {where}: {e}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise ExportError(f"{where} has no {name}") from None


def _load_module(model: Any, checkpoint: str, state: dict[str, Any]) -> torch.nn.Module:
    if isinstance(model, type):
        if not hasattr(model, "load_from_checkpoint"):
            raise ExportError(f"{model.__name__} is not a LightningModule class; pass a module instance instead")
        with serving(checkpoint, state):  # what was read: the file is not read again
            return model.load_from_checkpoint(checkpoint, map_location="cpu")
    model.load_state_dict(with_aliases(state["state_dict"], model))
    return model


def _monitored_score(state: dict[str, Any]) -> tuple[str | None, float | None]:
    """The monitored metric and this file's value of it, from a ModelCheckpoint-like callback's state."""
    for callback_state in (state.get("callbacks") or {}).values():
        if isinstance(callback_state, dict) and callback_state.get("monitor"):
            score = callback_state.get("current_score")
            return callback_state["monitor"], None if score is None else float(score)
    return None, None


def _torch_export(module: torch.nn.Module, args: tuple[Any, ...], path: str, opset: int, input_names: list[str],
                  output_names: list[str], dynamic_batch: bool, work: str) -> None:
    dynamic_axes = {n: {0: "batch"} for n in (*input_names, *output_names)} if dynamic_batch else None
    try:
        with warnings.catch_warnings(), contextlib.chdir(work):
            warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export")
            torch.onnx.export(module, args, path, input_names=input_names, output_names=output_names,
                              dynamic_axes=dynamic_axes, opset_version=opset, dynamo=False, export_params=True,
                              do_constant_folding=True, training=torch.onnx.TrainingMode.EVAL)
    except Exception as e:  # noqa: BLE001 - the exporter raises many types; the user needs the message
        raise ExportError(f"torch.onnx.export failed: {type(e).__name__}: {e}") from e


def _finish_model(path: str, metadata: dict[str, str], external: bool) -> None:
    """Add the provenance metadata; gather the weights into ``<path>.data`` when asked or needed."""
    import onnx

    model = onnx.load(path, load_external_data=True)
    for entry in list(model.metadata_props):
        if entry.key in metadata:
            model.metadata_props.remove(entry)
    for key, value in metadata.items():
        model.metadata_props.add(key=key, value=value)
    for leftover in os.listdir(os.path.dirname(path)):  # per-tensor files the exporter writes for >2 GiB models
        if leftover != os.path.basename(path):
            os.unlink(os.path.join(os.path.dirname(path), leftover))
    onnx.save_model(model, path, save_as_external_data=external, all_tensors_to_one_file=True,
                    location=os.path.basename(_atomic.data_path(path)), size_threshold=0)


def _max_abs_diff(path: str, args: tuple[Any, ...], expected: tuple[Any, ...], input_names: list[str]) -> float:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feeds = {name: a.detach().cpu().numpy() for name, a in zip(input_names, args)}
    got = session.run(None, feeds)
    if len(got) != len(expected):
        raise ExportError(f"the exported model has {len(got)} outputs, torch returns {len(expected)}")
    return max((float(np.max(np.abs(g - e.detach().cpu().numpy()))) if g.size else 0.0
                for g, e in zip(got, expected)), default=0.0)
