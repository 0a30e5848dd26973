"""Deployment export: an ONNX inference model from a checkpoint, checked against ONNX Runtime before it is kept, or
the module's weights as Hugging Face safetensors.

:func:`export_onnx` reads a checkpoint's weights (ORT or torch) once, lazily and without the optimizer state, into
your LightningModule, exports it with ``torch.onnx.export``, runs the result in ``onnxruntime.InferenceSession`` on
the example input next to the torch module, and keeps the file only when the largest absolute difference is within
the tolerance. The model's ``metadata_props`` record where it came from: the checkpoint, its global step and its
monitored score.

:func:`export_safetensors` writes the weights (the ``state_dict``, or one submodule's part of it) as the
``model.safetensors`` (or shards and their index) that ``from_pretrained`` reads, a tensor at a time, each checked
against its recorded checksum as it is read.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._export import _safetensors
from ._fit_state import _rng
from ._lightning import _lightning_adapter
from .errors import CheckpointError, CorruptCheckpointError
from ._export._module_loading import init_params, load_module, unsaved_init_args
from ._restore._reading import is_ort_checkpoint, read_weights
from .format import CheckpointReader, TensorInfo, _atomic, open_checkpoint
from .format._store import StorageOptions, Stores
from ._translation import MANIFEST
from ._translation.lightning_dict import EXTRA_PREFIX, aliases_of

__all__ = ["ExportError", "ExportReport", "SafetensorsReport", "check_export_config", "export_onnx",
           "export_safetensors", "load_module_class", "runtime"]

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
    onnxruntime: str = ""
    """The ONNX Runtime that ran the check: its version and package, e.g. ``1.32.0 (onnxruntime)``."""

    def __str__(self) -> str:
        source = f"{self.checkpoint} (step {self.global_step}"
        source += f", {self.monitor}={self.score:.6g})" if self.monitor and self.score is not None else ")"
        runtime = f"ONNX Runtime {self.onnxruntime}" if self.onnxruntime else "ONNX Runtime"
        return (f"exported {self.path} from {source}; {runtime} vs torch on the example input: max abs "
                f"difference {self.max_abs_diff:.3g} (tolerance {self.tolerance:g})")


def export_onnx(model: Any, checkpoint: str | os.PathLike[str], output: str | os.PathLike[str], *,
                example_input: Any = None, tolerance: float = 1e-5, opset: int = 17,
                input_names: list[str] | None = None, output_names: list[str] | None = None,
                dynamic_batch: bool = True, external_data: bool | None = None, reference: Any = None,
                verbose: bool = False) -> ExportReport:
    """Export ``checkpoint`` loaded into ``model`` to the ONNX file ``output``, verified with ONNX Runtime.

    Args:
        model: your LightningModule class (built with ``load_from_checkpoint``, so hparams come from the file) or a
            module instance (the checkpoint's weights are loaded into it).
        reference: the module that was trained (``OrtCheckpoint(export_best_to=...)`` passes the live one): the
            module rebuilt from the checkpoint's hyperparameters must have its parameter shapes and, given the
            checkpoint's weights, its outputs on the example input, so the report is about the model you trained.
        checkpoint: an ORT or torch checkpoint path, a sharded checkpoint directory, or an fsspec URL (read with the
            store's default configuration,
            e.g. ``AWS_*`` environment variables for S3).
        example_input: the input to export and compare with; defaults to the module's ``example_input_array``.
        tolerance: the largest absolute difference between ONNX Runtime and torch that is accepted.
        external_data: keep the weights in ``<output>.data`` (ONNX external data); by default only past 1 GiB.
        verbose: let ``torch.onnx.export``'s own output through (its graph dump when it fails) and give its whole
            message in the error; by default the error is its first line.
    Raises:
        ExportError: no example input, the rebuilt module is not ``reference``, the export failed, or ONNX Runtime
            differs from torch by more than ``tolerance`` (nothing is left at ``output`` then).
    """
    from ._export._consolidate import single_file

    checkpoint, output, stores = os.fspath(checkpoint), os.fspath(output), Stores()  # one store per location
    with single_file(checkpoint, stores) as source:  # a sharded directory: consolidated into a temporary file first
        state = read_weights(source, stores.of(source))
        module = load_module(model, source, state, ExportError)
        monitor, score = _monitored_score(state)
        global_step = state.get("global_step")
        hparams, hparams_name = dict(state.get("hyper_parameters") or {}), state.get("hparams_name")
        del state  # the weights are in the module: the file's pages are let go before the export needs memory
    module.eval()
    args = example_input if example_input is not None else getattr(module, "example_input_array", None)
    if args is None:
        raise ExportError("no example input: pass example_input or set example_input_array on the module",
                          checkpoint)
    args = args if isinstance(args, tuple) else (args,)
    input_names = input_names or default_names("input", len(args))
    expected = _forward(module, args, checkpoint)
    if reference is not None:
        _check_is_reference(module, reference, args, expected, tolerance, hparams, hparams_name, checkpoint)
    output_names = output_names or default_names("output", len(expected))
    source = stores.of(checkpoint).absolute(checkpoint)
    metadata = {"lightning_ort_ckpt.source_checkpoint": source,
                "lightning_ort_ckpt.global_step": "" if global_step is None else str(global_step),
                "lightning_ort_ckpt.monitor": monitor or "", "lightning_ort_ckpt.score": "" if score is None else repr(score)}
    nbytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    external = nbytes > _EXTERNAL_DATA_THRESHOLD if external_data is None else external_data
    directory = os.path.dirname(os.path.abspath(output))
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".export-") as work:
        staged = os.path.join(work, os.path.basename(output))
        torch_export(module, args, staged, opset=opset, input_names=input_names, output_names=output_names,
                     dynamic_batch=dynamic_batch, verbose=verbose, checkpoint=checkpoint)
        _finish_model(staged, metadata, external)
        diff = _max_abs_diff(staged, args, expected, input_names, checkpoint)
        if not diff <= tolerance:
            raise ExportError(f"ONNX Runtime's output differs from torch's by up to {diff:.3g}, more than the "
                              f"tolerance {tolerance:g}; nothing was written to {output}", checkpoint)
        if external:
            os.replace(_atomic.data_path(staged), _atomic.data_path(output))
        os.replace(staged, output)
    return ExportReport(output, checkpoint, global_step, monitor, score, diff, tolerance, external, runtime())


@dataclass(frozen=True)
class SafetensorsReport:
    """What :func:`export_safetensors` wrote: the files (``model.safetensors``, or shards and their index), how
    many tensors and bytes, and the prefix that was taken off their names."""

    folder: str
    files: list[str]
    checkpoint: str
    tensors: int
    nbytes: int
    prefix: str

    def __str__(self) -> str:
        which = f"the parameters and buffers under {self.prefix!r}" if self.prefix else "the parameters and buffers"
        return (f"exported {which} of {self.checkpoint} to {self.folder}: {self.tensors} tensors, "
                f"{self.nbytes:,} bytes in {len(self.files)} file(s) ({', '.join(map(os.path.basename, self.files))})")


def export_safetensors(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str], *, prefix: str = "",
                       max_shard_size: int = 5 * 10**9,
                       storage_options: StorageOptions | None = None) -> SafetensorsReport:
    """Write the module weights of ``checkpoint`` into the folder ``output`` as Hugging Face reads them:
    ``model.safetensors``, or past ``max_shard_size`` bytes ``model-0000i-of-0000n.safetensors`` and
    ``model.safetensors.index.json``. Add the model's ``config.json`` (``config.save_pretrained(output)``) and
    ``AutoModel...from_pretrained(output)`` loads them.

    Args:
        checkpoint: an ORT checkpoint file written by this library or by ORT, or a sharded checkpoint folder; a
            local path or an fsspec URL (``storage_options`` for its store).
        prefix: the submodule whose weights to write, named as they are inside it: ``"model"`` for a
            LightningModule holding ``self.model = AutoModelFor...`` writes ``model.*`` as ``*`` and leaves the rest
            (a loss's buffers, another head) out. ``""``: every key as the LightningModule names it.
        max_shard_size: the most bytes of tensors in one file.

    Every dtype is written as saved (integers and bool included; float16 and bfloat16 that ``ort_compatible``
    stored as float32 get their own dtype back). A tensor tied to another (stored once) is written once, under its
    first name, as ``save_pretrained`` does; ``from_pretrained`` ties it again. Memory: one tensor at a time (a
    sharded folder is first consolidated into a temporary file, a tensor at a time too).

    Raises:
        CorruptCheckpointError: a tensor does not match its recorded checksum, or the file is damaged.
        ExportError: a torch checkpoint (not an ORT one), no weight under ``prefix``, or a dtype safetensors has not.
    """
    from ._export._consolidate import single_file

    checkpoint, output, stores = os.fspath(checkpoint), os.fspath(output), Stores(storage_options)
    if max_shard_size < 1:
        raise ExportError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    prefix = prefix + "." if prefix and not prefix.endswith(".") else prefix
    with single_file(checkpoint, stores) as source:
        if not is_ort_checkpoint(source, stores.of(source)):
            raise ExportError("not an ORT checkpoint: the safetensors export reads ORT files and sharded "
                              "folders (a torch .ckpt holds its state_dict for torch.load)", checkpoint)
        with stores.of(source).fetched(source) as local, \
                open_checkpoint(local, verify=True) as reader:
            entries = _weight_entries(reader, prefix, checkpoint)
            files = _safetensors.write(entries, output, max_shard_size=max_shard_size, metadata={
                "format": "pt", "lightning_ort_ckpt.source_checkpoint": stores.of(checkpoint).absolute(checkpoint)})
    return SafetensorsReport(output, files, checkpoint, len(entries), sum(e.nbytes for e in entries), prefix)


def _weight_entries(reader: CheckpointReader, prefix: str, checkpoint: str) -> list[_safetensors.Entry]:
    """The ``state_dict`` entries under ``prefix`` (named without it), each read when it is written: its bytes
    read into memory of its own (never mapped) and checked against the checksum recorded for it."""
    stored = {**reader.trainable, **reader.frozen}
    if MANIFEST in reader.properties:  # ours: the manifest's state_dict keys, tied keys, narrow floats
        try:
            manifest = json.loads(str(reader.properties[MANIFEST]))
            keys, aliases, cast = manifest["state_dict"], manifest.get("aliases", {}), manifest.get("cast", {})
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"its Lightning metadata ({MANIFEST}) is damaged: {e}", checkpoint) from None
    else:  # written by ORT alone: its parameters are the state_dict
        keys, aliases, cast = [n for n in stored if not n.startswith(EXTRA_PREFIX)], {}, {}
    entries = []
    for key in keys:
        if key in aliases or not key.startswith(prefix):
            continue
        info = stored.get(key)
        if info is None:
            raise CorruptCheckpointError(f"parameter {key!r} named in its Lightning metadata is missing", checkpoint)
        if info.storage not in ("inline", "external"):
            raise ExportError(f"parameter {key!r} has no data (a nominal checkpoint: names and types only)",
                              checkpoint)
        dtype = getattr(torch, cast[key]) if key in cast else info.dtype.to_torch()
        if dtype not in _safetensors.DTYPES:
            raise ExportError(f"parameter {key!r} is {dtype}, which safetensors has no type for", checkpoint)
        entries.append(_safetensors.Entry(key[len(prefix):], dtype, info.shape, _reading_of(reader, info, dtype)))
    if not entries and prefix:
        tops = sorted({k.split(".")[0] for k in keys})
        raise ExportError(f"no parameter or buffer under prefix {prefix.rstrip('.')!r}; the module's submodules "
                          f"are {', '.join(tops) or 'none'}", checkpoint)
    if not entries:  # a DCP folder of another tree than Lightning's, say: an empty file would load as nothing
        raise ExportError("it holds no module weights (no state_dict): nothing to export", checkpoint)
    return entries


def _reading_of(reader: CheckpointReader, info: TensorInfo, dtype: torch.dtype) -> Any:
    """The function that reads ``info``'s bytes (verified) as ``dtype``'s: converted back for a tensor
    ``ort_compatible`` stored as float32."""
    def read() -> Any:
        raw = reader.read_bytes(info)
        if info.dtype.to_torch() == dtype:
            return raw
        return torch.from_numpy(raw).view(info.dtype.to_torch()).to(dtype).view(torch.uint8).numpy()
    return read


def check_export_config(module: Any, tolerance: Any, *, trial_export: bool = True) -> None:
    """What ``OrtCheckpoint(export_best_to=...)`` checks in ``setup``, so a misconfiguration stops the run before it
    trains, not after: ``tolerance`` is a number >= 0; the module class can be rebuilt from a checkpoint (every
    required ``__init__`` argument is in its saved hparams, and when some argument is not, the module built from the
    hparams, on the meta device, has this module's parameter shapes); it has an ``example_input_array``; and, with
    ``trial_export``, the module as it is exports and runs in ONNX Runtime on it (skipped for a module that builds its
    layers in ``configure_model``, which Lightning calls after ``setup``). Random states are left as they were."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ExportError(f"export_tolerance must be a number >= 0, got {tolerance!r}")
    cls = type(module)
    hparams = dict(getattr(module, "hparams", {}))
    hparams_name = _lightning_adapter.hparams_name(module)
    unsaved = unsaved_init_args(cls, hparams, hparams_name)
    missing = [p.name for p in init_params(cls) if p.name in unsaved and p.default is p.empty]
    if missing:
        raise ExportError(f"export_best_to rebuilds {cls.__name__} from the best checkpoint, but its __init__ "
                          f"arguments {', '.join(missing)} are not saved: call self.save_hyperparameters() in "
                          f"__init__")
    if getattr(module, "example_input_array", None) is None:
        raise ExportError(f"export_best_to needs an example input: set example_input_array on {cls.__name__}")
    states = _rng.capture()
    try:
        if unsaved:
            _check_rebuilds(module, hparams, hparams_name, unsaved)
        if trial_export and not _builds_in_configure_model(cls):
            _trial_export(module)
    finally:
        _rng.restore(states)


def _check_rebuilds(module: Any, hparams: dict[str, Any], hparams_name: Any, unsaved: list[str]) -> None:
    """The module ``load_from_checkpoint`` will build from ``hparams`` (on the meta device: no memory, no weights)
    has ``module``'s parameter and buffer shapes. An ``__init__`` that cannot run on the meta device is left to the
    comparison at export time."""
    cls = type(module)
    params = init_params(cls)
    if hparams_name in {p.name for p in params}:
        kwargs = {hparams_name: hparams}
    elif any(p.kind is p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values()):
        kwargs = hparams
    else:
        kwargs = {k: v for k, v in hparams.items() if k in {p.name for p in params}}
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rebuilt = cls(**kwargs)
    except Exception:  # noqa: BLE001 - the user's __init__ may raise anything off its usual device
        return
    difference = _shape_difference(rebuilt.state_dict(), module.state_dict())
    if difference:
        raise ExportError(f"export_best_to rebuilds {cls.__name__} from the best checkpoint's hyperparameters, and "
                          f"built so it is not this module ({difference}): its __init__ arguments "
                          f"{', '.join(unsaved)} are not saved; call self.save_hyperparameters() in __init__")


def _shape_difference(rebuilt: dict[str, Any], trained: dict[str, Any]) -> str:
    """The first parameter or buffer that the two modules do not have alike, in words; "" when they agree."""
    for name, tensor in trained.items():
        if name not in rebuilt:
            return f"it has no {name}"
        if tuple(rebuilt[name].shape) != tuple(tensor.shape):
            return f"{name} is {list(rebuilt[name].shape)} there, {list(tensor.shape)} here"
    extra = [name for name in rebuilt if name not in trained]
    return f"it has {extra[0]}, which the trained module has not" if extra else ""


def _builds_in_configure_model(cls: type) -> bool:
    return any("configure_model" in vars(base) or "configure_sharded_model" in vars(base)
               for base in cls.__mro__[:-1] if base.__module__.split(".")[0] not in ("lightning", "pytorch_lightning"))


def _trial_export(module: Any) -> None:
    """Export the module as it is and run the model in ONNX Runtime on the example input (at ``setup``: an export
    that would fail, fails before training)."""
    args = module.example_input_array
    args = args if isinstance(args, tuple) else (args,)
    input_names = default_names("input", len(args))
    with _eval_mode(module):
        expected = _forward(module, args, None)
        with tempfile.TemporaryDirectory(prefix="ort-ckpt-trial-export-") as work:
            path = os.path.join(work, "model.onnx")
            torch_export(module, args, path, opset=17, input_names=input_names,
                         output_names=default_names("output", len(expected)))
            _max_abs_diff(path, args, expected, input_names, None)


@contextlib.contextmanager
def _eval_mode(module: torch.nn.Module) -> Any:
    """``module`` in eval mode for the block; every submodule's own mode afterwards."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


def default_names(prefix: str, count: int) -> list[str]:
    """``input`` for one, ``input0``, ``input1``... for several: the ONNX names of the inputs (or outputs)."""
    return [f"{prefix}{i}" for i in range(count)] if count > 1 else [prefix]


def _forward(module: torch.nn.Module, args: tuple[Any, ...], checkpoint: str | None) -> tuple[Any, ...]:
    try:
        with torch.no_grad():
            out = module(*args)
    except Exception as e:  # noqa: BLE001 - the user's forward may raise anything
        raise ExportError(f"the module's forward failed on the example input: {type(e).__name__}: {e}",
                          checkpoint) from e
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _check_is_reference(module: torch.nn.Module, reference: torch.nn.Module, args: tuple[Any, ...],
                        expected: tuple[Any, ...], tolerance: float, saved: dict[str, Any], hparams_name: Any,
                        checkpoint: str) -> None:
    """The module rebuilt from the checkpoint is the trained one: same parameter shapes, and the trained module
    given the checkpoint's weights (``torch.func.functional_call``: it is neither copied nor changed) computes the
    same outputs on the example input."""
    cls = type(module)
    weights = module.state_dict()
    difference = _shape_difference(weights, reference.state_dict())
    diff = 0.0
    if not difference:
        got = _call_with(reference, weights, args, checkpoint)
        diff = max((float((g.detach().cpu().double() - e.detach().cpu().double()).abs().max()) if e.numel() else 0.0
                    for g, e in zip(got, expected)), default=0.0) if len(got) == len(expected) else float("inf")
    if difference or not diff <= tolerance:
        unsaved = unsaved_init_args(cls, saved, hparams_name)
        how = (f"is not the module that was trained ({difference})" if difference else
               f"computes other outputs than the module that was trained, given the same weights (max abs "
               f"difference {diff:.3g} on the example input)")
        why = (f": its __init__ arguments {', '.join(unsaved)} are not in the saved hyperparameters; call "
               f"self.save_hyperparameters() in __init__" if unsaved else "")
        raise ExportError(f"{cls.__name__} rebuilt from the checkpoint's hyperparameters {how}{why}", checkpoint)


def _call_with(reference: torch.nn.Module, weights: dict[str, Any], args: tuple[Any, ...],
               checkpoint: str) -> tuple[Any, ...]:
    """``reference``'s outputs on ``args`` given ``weights``, the module itself neither copied nor changed. A tied
    tensor is given once, under its first name (``functional_call`` ties the others to it and refuses both)."""
    tied = aliases_of(reference)
    device = next(iter(reference.state_dict().values()), torch.empty(0)).device
    try:
        with _eval_mode(reference), torch.no_grad():
            got = torch.func.functional_call(
                reference, {k: v.to(device) for k, v in weights.items() if k not in tied},
                tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
    except Exception as e:  # noqa: BLE001 - the user's forward, or torch's stateless call, may raise anything
        raise ExportError(f"cannot run the trained module with the checkpoint's weights to compare it with the "
                          f"rebuilt one: {type(e).__name__}: {e}", checkpoint) from e
    return tuple(got) if isinstance(got, (tuple, list)) else (got,)


def load_module_class(spec: str) -> type:
    """``"package.module:ClassName"`` or ``"path/to/file.py:ClassName"`` -> the class (for the CLI)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ExportError(f"--module wants 'package.module:ClassName' or 'file.py:ClassName', got {spec!r}")
    if where.endswith(".py"):
        found = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        if found is None or found.loader is None or not os.path.exists(where):
            raise ExportError(f"cannot import {where}")
        module = sys.modules.get(found.name)
        if module is None or os.path.abspath(getattr(module, "__file__", None) or "") != os.path.abspath(where):
            module = importlib.util.module_from_spec(found)
            sys.modules[found.name] = module  # so that classes pickled by name, and load_from_checkpoint, find it
            found.loader.exec_module(module)
        # (a file already imported under its name is used as it is: a second copy of its classes would not be the
        # classes the process already holds, which Enum and dataclass hyperparameters are checked against)
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


def _monitored_score(state: dict[str, Any]) -> tuple[str | None, float | None]:
    """The monitored metric and this file's value of it, from a ModelCheckpoint-like callback's state."""
    for callback_state in (state.get("callbacks") or {}).values():
        if isinstance(callback_state, dict) and callback_state.get("monitor"):
            score = callback_state.get("current_score")
            return callback_state["monitor"], None if score is None else float(score)
    return None, None


_EXPORT_MODES = {  # torch.onnx.export's mode, constant folding, initializers kept as inputs
    "deploy": (torch.onnx.TrainingMode.EVAL, True, False),
    "train": (torch.onnx.TrainingMode.TRAINING, False, False),
    # eval mode with every parameter under its own name: no Conv-BatchNorm folding, no merging of equal initializers
    "eval": (torch.onnx.TrainingMode.EVAL, False, True),
}


def torch_export(module: torch.nn.Module, args: tuple[Any, ...], path: str, *, opset: int, input_names: list[str],
                 output_names: list[str], dynamic_batch: bool = True, mode: str = "deploy", verbose: bool = False,
                 checkpoint: str | None = None, error: type[CheckpointError] = ExportError) -> None:
    """``torch.onnx.export`` (TorchScript) to ``path``, run in its folder (where the exporter may write per-tensor
    files). Every input and output gets a dynamic batch dimension. The exporter prints its IR graph to stdout when
    it fails: shown with ``verbose`` only, as is its whole message; otherwise ``error`` gives the first line."""
    training, fold, keep_inputs = _EXPORT_MODES[mode]
    dynamic_axes = {n: {0: "batch"} for n in (*input_names, *output_names)} if dynamic_batch else None
    try:
        with warnings.catch_warnings(), contextlib.chdir(os.path.dirname(path) or "."), \
                (contextlib.nullcontext() if verbose else hidden_native_output(1)):
            warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export")
            warnings.filterwarnings("ignore", message=".*Removing mutation from node")
            torch.onnx.export(module, args, os.path.basename(path), input_names=input_names,
                              output_names=output_names, dynamic_axes=dynamic_axes, opset_version=opset, dynamo=False,
                              export_params=True, do_constant_folding=fold, keep_initializers_as_inputs=keep_inputs,
                              training=training)
    except Exception as e:  # noqa: BLE001 - the exporter raises many types; the user needs the message
        text = str(e).strip()
        detail = text if verbose else (text.splitlines() or [""])[0]
        more = "" if verbose or detail == text else " (verbose=True shows the exporter's whole report)"
        raise error(f"torch.onnx.export failed: {type(e).__name__}: {detail}{more}", checkpoint) from e


@contextlib.contextmanager
def hidden_native_output(fd: int) -> Any:
    """File descriptor ``fd`` (1: stdout, 2: stderr) sent to the null device for the block: what C++ code (torch's
    exporter, ONNX Runtime's graph passes) prints there stays out of the user's output."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(fd)
    with open(os.devnull, "wb") as devnull:
        os.dup2(devnull.fileno(), fd)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


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


def runtime() -> str:
    """The ONNX Runtime installed, which the export check runs on: the maintained ``onnxruntime`` (the ``deploy``
    extra) or ``onnxruntime-training`` 1.19.2 (the ``ort`` extra); both are the module ``onnxruntime``."""
    import onnxruntime

    package = "onnxruntime-training" if importlib.util.find_spec("onnxruntime.training") else "onnxruntime"
    return f"{onnxruntime.__version__} ({package})"


def _max_abs_diff(path: str, args: tuple[Any, ...], expected: tuple[Any, ...], input_names: list[str],
                  checkpoint: str | None) -> float:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    feeds = {name: a.detach().cpu().numpy() for name, a in zip(input_names, args)}
    try:
        session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        got = session.run(None, feeds)
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types
        raise ExportError(f"ONNX Runtime cannot run the exported model: {str(e).strip().splitlines()[0]}",
                          checkpoint) from e
    if len(got) != len(expected):
        raise ExportError(f"the exported model has {len(got)} outputs, torch returns {len(expected)}", checkpoint)
    return max((float(np.max(np.abs(g - e.detach().cpu().numpy()))) if g.size else 0.0
                for g, e in zip(got, expected)), default=0.0)
