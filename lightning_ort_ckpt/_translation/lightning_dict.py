"""Lightning checkpoint dict <-> ORT checkpoint, losslessly.

What goes where (``docs/mapping.md`` has the full table):

- ``state_dict``: trainable parameters -> ORT ``requires_grad_params``, everything else (frozen parameters, buffers,
  and parameters no optimizer trains) -> ``frozen_params``; names are the ``state_dict`` keys, as
  ``torch.onnx.export`` names initializers. A tensor under several keys (tied weights) is stored once, under its
  first key (the name ``named_parameters()`` and ``torch.onnx.export`` give it); the other keys are aliases.
- ``optimizer_states``: per-parameter tensors -> ORT optimizer groups (see ``optimizers``); everything else of the
  optimizer's ``state_dict`` (hyperparameters, non-tensor state) -> the manifest.
- every other key (``epoch``, ``global_step``, ``loops``, ``callbacks``, ``lr_schedulers``, hparams, user keys...)
  -> the manifest, with tensors nested anywhere stored as frozen tensors named ``lightning:<key path>``.

The manifest is one JSON document in the string property ``lightning.checkpoint`` (encoding in ``values``). With
``ort_compatible=True``, float16, bfloat16 and float8 tensors are stored as float32 (which holds them exactly) and
the manifest records their dtypes, so they come back bit for bit.
"""

from __future__ import annotations

import json
import re
import warnings
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ._torch_compat import set_state_dict_metadata, state_dict_metadata
from ..errors import CheckpointWarning, CorruptCheckpointError
from ..format import GROUP_ZERO, CheckpointContents, DataType, OptimizerGroup, StoredAs
from ..format._contents import Tensor
from . import FORMAT, MANIFEST, optimizers, values
from .counters import check_counters

VERSION = 1
EXTRA_PREFIX = "lightning:"
_PLAIN = re.compile(r"[\w.\-=]{1,48}")
_NARROW_FLOATS = {torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2,
                  torch.float8_e5m2fnuz}


@dataclass
class ModuleInfo:
    """What ORT needs and the checkpoint dict does not say: which ``state_dict`` entries are trainable, and the
    name of each optimizer's parameters in torch's index order (one list per optimizer)."""

    trainable: set[str] = field(default_factory=set)
    optimizer_params: list[list[str]] = field(default_factory=list)

    @classmethod
    def from_module(cls, module: torch.nn.Module, optimizers_: list[torch.optim.Optimizer]) -> ModuleInfo:
        names = {id(p): clean_name(n) for n, p in module.named_parameters()}
        params = [[names.get(id(p), "") for g in opt.param_groups for p in g["params"]] for opt in optimizers_]
        return cls(trainable=trainable_set(module, params[0] if params else None), optimizer_params=params)


def trainable_set(module: torch.nn.Module, first_optimizer: list[str] | None) -> set[str]:
    """The parameters ORT trains: those with ``requires_grad`` that the first optimizer holds.

    ORT trains with one optimizer, whose state (``group0``) must cover every trainable parameter of the file, and a
    ``requires_grad`` parameter that no optimizer holds never changes in torch: so it is frozen for ORT too. With no
    optimizer known (``None``), every ``requires_grad`` parameter.
    """
    held = None if first_optimizer is None else set(first_optimizer)
    return {clean_name(n) for n, p in module.named_parameters()
            if p.requires_grad and (held is None or clean_name(n) in held)}


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter name as the module's ``state_dict`` spells it: without the module names of torch's wrappers
    (FSDP, activation checkpointing), which their state-dict hooks remove."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def aliases_of(module: torch.nn.Module) -> dict[str, str]:
    """``state_dict`` key -> the first key of the same tensor, for tensors registered under several names."""
    first: dict[int, str] = {}
    aliases = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if tensor is None:
            continue
        canonical = first.setdefault(id(tensor), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


def with_aliases(state_dict: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """``state_dict`` with the keys that ``module`` ties to another one filled from it (a file ORT alone wrote
    stores a tied tensor once, under its first name)."""
    missing = {a: c for a, c in aliases_of(module).items() if a not in state_dict and c in state_dict}
    if not missing:
        return state_dict
    out = type(state_dict)(state_dict)
    out.update((a, state_dict[c]) for a, c in missing.items())
    metadata = state_dict_metadata(state_dict)
    if metadata is not None:
        set_state_dict_metadata(out, metadata)
    return out


def _aliases_in(state_dict: dict[str, Any]) -> dict[str, str]:
    """key -> first key holding the very same tensor view (same memory, dtype, shape and strides).

    Such entries hold equal values by construction, so storing one of them loses nothing: tied weights, and any
    other tensor registered twice.
    """
    first: dict[tuple[Any, ...], str] = {}
    aliases = {}
    for key, t in state_dict.items():
        if isinstance(t, torch.Tensor) and t.numel() and t.layout == torch.strided and t.device.type != "meta":
            canonical = first.setdefault((t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()), key)
            if canonical != key:
                aliases[key] = canonical
    return aliases


def to_ort(checkpoint: dict[str, Any], info: ModuleInfo | None = None, *, ort_compatible: bool = False) -> CheckpointContents:
    """The ORT checkpoint holding everything in Lightning's checkpoint dict."""
    out = CheckpointContents()
    cast: dict[str, str] = {}

    def store(t: torch.Tensor, where: str) -> torch.Tensor | StoredAs:
        if ort_compatible and t.dtype in _NARROW_FLOATS:
            cast[where] = str(t.dtype).removeprefix("torch.")
            return StoredAs(t, DataType.FLOAT)  # converted chunk by chunk as it is written: no whole float32 copy
        return t

    state_dict = checkpoint.get("state_dict", {})
    trainable = info.trainable if info is not None else set()
    aliases = _aliases_in(state_dict)
    for key, tensor in state_dict.items():
        if key.startswith(EXTRA_PREFIX):
            raise ValueError(f"state_dict key {key!r} uses the prefix {EXTRA_PREFIX!r} reserved for other tensors")
        if key not in aliases and isinstance(tensor, torch.Tensor):
            (out.trainable if key in trainable else out.frozen)[key] = store(tensor, key)

    def extra(path: tuple[str, ...], tensor: torch.Tensor) -> str:
        name = EXTRA_PREFIX + "/".join(map(_name_part, path))
        while name in out.frozen:
            name += "'"
        out.frozen[name] = store(tensor, name)
        return name

    manifest: dict[str, Any] = {"format": FORMAT, "version": VERSION, "keys": list(checkpoint),
                                "state_dict": list(state_dict), "aliases": aliases, "optimizers": [], "values": {}}
    for index, opt_state in enumerate(checkpoint.get("optimizer_states", [])):
        manifest["optimizers"].append(_optimizer_to_ort(index, opt_state, info, out, store, extra))
    for key, value in checkpoint.items():
        if key not in ("state_dict", "optimizer_states"):
            manifest["values"][key] = values.encode(value, extra, (key,))
    # a module's extra state that is no tensor (get_extra_state's dict): a value, its tensors beside the others
    manifest["state_dict_values"] = {key: values.encode(v, extra, ("state_dict", key))
                                     for key, v in state_dict.items() if not isinstance(v, torch.Tensor)}
    manifest["cast"] = cast
    # torch keeps each module's state-dict version here; its loaders read it (BatchNorm, for one)
    manifest["state_dict_metadata"] = values.encode(state_dict_metadata(state_dict), extra)
    out.properties[MANIFEST] = json.dumps(manifest, separators=(",", ":"), allow_nan=False)
    return out


def _name_part(key: str) -> str:
    """A key as part of a tensor name: itself when short and plain, else a stable short hash (a callback's state
    key is a dict repr, ModelCheckpoint keys scores by file path)."""
    return key if _PLAIN.fullmatch(key) else f"#{zlib.crc32(key.encode()):08x}"


def _optimizer_to_ort(index: int, opt_state: dict[str, Any], info: ModuleInfo | None, out: CheckpointContents,
                      store: Any, extra: values.TensorSink) -> dict[str, Any]:
    params = info.optimizer_params if info is not None else []
    known = index < len(params) and all(params[index])
    order = [i for g in opt_state.get("param_groups", []) for i in g.get("params", [])]
    names = params[index] if known else [f"param{i}" for i in order]
    by_index = dict(zip(order, names)) if len(names) == len(order) else {}
    group = optimizers.group_name(index, opt_state, known and bool(by_index))
    ort = out.optimizer_groups[group] = OptimizerGroup(step=optimizers.common_step(opt_state),
                                                       initial_learning_rate=optimizers.initial_learning_rate(opt_state))

    def sink(path: tuple[str, ...], tensor: torch.Tensor) -> Any:
        # path is ("state", <param index>, <state key>) for per-parameter state, which goes to the ORT group
        if len(path) == 3 and path[0] == "state" and path[1].isdigit() and int(path[1]) in by_index:
            param, momentum = by_index[int(path[1])], optimizers.momentum_name(path[2], group)
            ort.states.setdefault(param, {})[momentum] = store(tensor, f"{group}/{param}/{momentum}")
            return [group, param, momentum]
        return extra(("optimizer_states", str(index), *path), tensor)

    encoded = values.encode(_state_with_str_keys(opt_state), sink)
    return {"group": group, "params": names, "ort_step": ort.step, "state_dict": encoded}


def _state_with_str_keys(opt_state: dict[str, Any]) -> dict[str, Any]:
    """torch keys per-parameter state by int index; the encoder's path needs them as strings, restored on load."""
    return {**opt_state, "state": {str(k): v for k, v in opt_state.get("state", {}).items()}}


def from_ort(ck: CheckpointContents, path: str, *, optimizer_states: bool = True) -> dict[str, Any]:
    """Lightning's checkpoint dict from an ORT checkpoint written by :func:`to_ort`, possibly trained on by ORT since.

    ``optimizer_states=False`` leaves the key out (``ck`` may then lack the optimizer groups: an export reads only
    the module's tensors). For a file that ORT alone wrote (no manifest) see :func:`plain_ort_to_lightning`.
    """
    try:
        text = ck.properties[MANIFEST]
        if not isinstance(text, str):
            raise TypeError(f"its {MANIFEST} property is a number, not JSON text")
        manifest = json.loads(text)
        if manifest.get("format") != FORMAT or not isinstance(manifest.get("version"), int):
            raise ValueError("not a lightning-ort-ckpt manifest")
        if manifest["version"] > VERSION:
            raise CorruptCheckpointError(f"written by a newer lightning-ort-ckpt (manifest version "
                                         f"{manifest['version']}); upgrade to load it", path)
        return check_counters(_from_manifest(ck, manifest, path, optimizer_states), path)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, ArithmeticError) as e:  # RecursionError too
        if isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"its Lightning metadata ({MANIFEST}) is damaged: {e}", path) from None


def _from_manifest(ck: CheckpointContents, manifest: dict[str, Any], path: str, optimizer_states: bool) -> dict[str, Any]:
    params = {**ck.trainable, **ck.frozen}
    cast = manifest.get("cast", {})

    def restore(t: Tensor, where: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):  # read by our reader: torch's where torch is loaded, as here
            raise CorruptCheckpointError(f"tensor {where!r} was read as {type(t).__name__}, not a torch tensor", path)
        return t.to(getattr(torch, cast[where])) if where in cast else t

    def source(ref: Any) -> torch.Tensor:
        if isinstance(ref, str):
            if ref not in params:
                raise CorruptCheckpointError(f"tensor {ref!r} named in its Lightning metadata is missing", path)
            return restore(params[ref], ref)
        group, param, momentum = ref
        try:
            t = ck.optimizer_groups[group].states[param][momentum]
        except KeyError:
            raise CorruptCheckpointError(f"optimizer state {group}/{param}/{momentum} named in its Lightning "
                                         "metadata is missing", path) from None
        return restore(t, f"{group}/{param}/{momentum}")

    aliases = manifest.get("aliases", {})
    others = manifest.get("state_dict_values", {})
    missing = [k for k in manifest["state_dict"] if k not in others and aliases.get(k, k) not in params]
    if missing:
        raise CorruptCheckpointError(f"parameter {missing[0]!r} is missing ({len(missing)} in all)", path)
    out: dict[str, Any] = {}
    for key in manifest["keys"]:
        if key == "state_dict":
            stored = {k: values.decode(others[k], source) if k in others else restore(params[k], k)
                      for k in manifest["state_dict"] if k not in aliases}
            # an alias is the very tensor of its first name, as tied weights are in the module
            out[key] = OrderedDict((k, stored[aliases.get(k, k)]) for k in manifest["state_dict"])
            metadata = values.decode(manifest.get("state_dict_metadata"), source)
            if metadata is not None:
                set_state_dict_metadata(out[key], metadata)
        elif key == "optimizer_states":
            if optimizer_states:
                out[key] = [_optimizer_from_ort(entry, ck, source, path) for entry in manifest["optimizers"]]
        else:
            out[key] = values.decode(manifest["values"][key], source)
    return out


def _optimizer_from_ort(entry: dict[str, Any], ck: CheckpointContents, source: values.TensorSource,
                        path: str) -> dict[str, Any]:
    group = ck.optimizer_groups.get(entry["group"])
    ort_group = ck.optimizer_groups.get(GROUP_ZERO)
    if entry["group"] == "optimizer0" and ort_group is not None:
        # Lightning saved no group0 (the first optimizer is not Adam-like); ORT's Optimizer made one: it trained
        warnings.warn(f"{path}: ONNX Runtime trained this checkpoint ({ort_group.step} optimizer steps) after "
                      f"Lightning saved it; the weights are ORT's, but the first optimizer's state "
                      f"({_state_kinds(entry)}) is Lightning's from before and is not what ORT used",
                      CheckpointWarning, stacklevel=4)
    if group is None:
        # saved by ORT without optimizer state (its default): the hyperparameters are here, the moments are not
        warnings.warn(f"{path} holds no optimizer state (ONNX Runtime saves it only with "
                      f"include_optimizer_state=True); the optimizer restarts with its saved hyperparameters",
                      CheckpointWarning, stacklevel=4)
        state = values.decode({**entry["state_dict"], "state": {}}, source)
        state["state"] = {}
        return state
    state = values.decode(entry["state_dict"], source)
    state["state"] = {int(k): v for k, v in state.get("state", {}).items()}
    if group.step != entry["ort_step"]:
        # ORT trained from this file and saved again: momentums and weights are ORT's, its step is newer than
        # torch's per-parameter step tensors, which ORT does not update.
        warnings.warn(f"{path}: ONNX Runtime trained {group.step - entry['ort_step']} more optimizer steps after "
                      f"Lightning saved this checkpoint; weights, optimizer moments and step come from ORT, while "
                      f"epoch, global_step and loop progress stay as Lightning last saved them",
                      CheckpointWarning, stacklevel=4)
        for s in state["state"].values():
            step = s.get("step")
            s["step"] = (torch.full_like(step, group.step) if isinstance(step, torch.Tensor)
                         else type(step)(group.step) if step is not None else step)
    return state


def _state_kinds(entry: dict[str, Any]) -> str:
    kinds = sorted({k for s in entry["state_dict"].get("state", {}).values() if isinstance(s, dict) for k in s})
    return ", ".join(kinds) or "hyperparameters only"


def plain_ort_to_lightning(ck: CheckpointContents, lightning_version: str) -> dict[str, Any]:
    """A Lightning checkpoint dict for a file written by ORT alone (no Lightning metadata).

    Weights come from the file; ``global_step`` is ORT's optimizer step; epoch starts at zero and schedulers start
    fresh. ``loops`` and ``optimizer_states`` are left out: both need the live trainer (see ``OrtCheckpointIO``).
    """
    group = ck.optimizer_groups.get(GROUP_ZERO)
    return {"epoch": 0, "global_step": group.step if group else 0, "pytorch-lightning_version": lightning_version,
            "state_dict": {**ck.trainable, **ck.frozen}, "lr_schedulers": []}
