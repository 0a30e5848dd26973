"""Typed, pickle-free encoding of arbitrary checkpoint values as JSON plus tensors.

Lightning checkpoints hold nested dicts, lists and tuples of ints, floats, strings, None and tensors. ORT's property
bag holds only flat int64, float32 and string values, so the values are encoded as one JSON document (stored as a
string property) and every tensor, wherever it is nested, is handed to a *tensor sink* that stores it as a real
tensor in the file and returns a JSON reference to it. Decoding reverses this with a *tensor source*.

JSON values stand for themselves, with these exceptions, each a one-key object whose key is a tag:

==================  ================================================================================
``{"__tensor__": r}``   a torch tensor; ``r`` is the sink's reference (see ``_translation.lightning_dict``)
``{"__ndarray__": r}``  a numpy array stored as a tensor
``{"__float__": s}``    a float JSON cannot spell: ``"nan"``, ``"inf"``, ``"-inf"`` (finite floats are JSON
                        numbers with Python's shortest round-trip repr, so float64 values come back exactly)
``{"__tuple__": [...]}``  a tuple (a namedtuple comes back as a plain tuple); ``{"__set__": [...]}`` a set;
                        ``{"__size__": [...]}`` a ``torch.Size``
``{"__dict__": [[k, v], ...]}``  a dict whose keys are not all strings, or that uses a tag as a key;
                        ``{"__odict__": [[k, v], ...]}`` an OrderedDict (other dict subclasses come back as dicts)
``{"__numpy__": [dtype, v]}``  a numpy scalar
``{"__bytes__": b64}``  bytes; ``{"__dtype__": "float32"}`` a torch dtype; ``{"__device__": "cpu"}`` a device
``{"__path__": s}``     a pathlib path; ``{"__namespace__": {...}}`` an argparse Namespace
``{"__enum__": [q, v]}``  an ``enum.Enum`` member (``IntEnum`` and ``StrEnum`` too): ``q`` is its class's
                        qualified name ``"module:Qual.Name"``, ``v`` the member's encoded value
``{"__dataclass__": [q, {...}]}``  a dataclass instance: its class's qualified name and its ``init`` fields, encoded
``{"__omegaconf__": v}``  an OmegaConf ``DictConfig`` or ``ListConfig`` (Hydra configs): its container, interpolations
                        unresolved and ``???`` kept; it loads as a ``DictConfig``/``ListConfig`` again where
                        omegaconf is installed (a structured config comes back untyped), else as a placeholder
``{"__unencodable__": s}``  a value with no faithful plain form (an ``nn.Module`` hparam, a local class...): saved
                        as a readable description with a warning naming its key; it loads as an
                        :class:`Unsaved` placeholder that raises ``CheckpointError`` when used
==================  ================================================================================

Classes are resolved by name only among modules the process has already imported (importing one runs its code,
and a file's content must never choose what runs), and only to an ``Enum`` or dataclass: its constructor is the
only code the file makes run. A class that cannot be resolved, or that no longer accepts the saved value (a member
or field renamed since), loads as an :class:`Unsaved` placeholder naming it.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import enum
import math
import pathlib
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, CheckpointWarning

TensorSink = Callable[[tuple[str, ...], torch.Tensor], Any]
TensorSource = Callable[[Any], torch.Tensor]

_TAGS = frozenset({"__tensor__", "__ndarray__", "__float__", "__tuple__", "__set__", "__dict__", "__odict__",
                   "__size__", "__numpy__",
                   "__bytes__", "__dtype__", "__device__", "__path__", "__namespace__", "__enum__", "__dataclass__",
                   "__omegaconf__", "__unencodable__"})


class Unsaved:
    """A value the checkpoint could not keep (or whose class this process cannot resolve).

    Any use of it (comparison, hashing, truth, attributes, calls, iteration, indexing, arithmetic, conversion to a
    number or path, formatting with a format spec, ``with``) raises ``CheckpointError``, so a model built from loaded
    hyperparameters fails loudly instead of silently taking another branch; pass the value again
    (``load_from_checkpoint(path, name=value)``) to replace it. ``repr``, ``str`` and ``format`` without a spec give
    the description that was saved.
    """

    __slots__ = ("_description",)

    def __init__(self, description: str) -> None:
        object.__setattr__(self, "_description", description)

    def __repr__(self) -> str:  # str() too: loggers print hyperparameters
        return object.__getattribute__(self, "_description")

    def __deepcopy__(self, memo: Any) -> Unsaved:
        return self

    def __copy__(self) -> Unsaved:
        return self

    def __format__(self, spec: str) -> str:  # f"{value}" in a log line describes it; f"{value:.3f}" uses it
        return repr(self) if not spec else Unsaved._refuse(self)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise CheckpointError(f"a checkpoint value was not saved and cannot be used: {self!r}; pass it again "
                              "(e.g. as a keyword argument of load_from_checkpoint) or save it in a form the "
                              "checkpoint keeps (see lightning_ort_ckpt._translation.values)")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # protocol probes (copy, pickle, typing) are answered "absent"
        return Unsaved._refuse(self)

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = __bool__ = __iter__ = _refuse
    __len__ = __getitem__ = __contains__ = __int__ = __float__ = __index__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __divmod__ = __rdivmod__ = __pow__ = __rpow__ = _refuse
    __matmul__ = __rmatmul__ = __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _refuse
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = __neg__ = __pos__ = __abs__ = __invert__ = _refuse
    __round__ = __trunc__ = __floor__ = __ceil__ = __complex__ = __fspath__ = _refuse
    __call__ = __setitem__ = __delitem__ = __reversed__ = __enter__ = __exit__ = _refuse
    __setattr__ = __delattr__ = _refuse


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: str, kind: str) -> type | None:
    """The Enum or dataclass class named ``"module:Qual.Name"``, from modules already imported; else None."""
    module_name, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split(".") if obj is not None else ():
        if part.startswith("<"):
            return None
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        return None
    ok = issubclass(obj, enum.Enum) if kind == "__enum__" else dataclasses.is_dataclass(obj)
    return obj if ok else None


def encode(value: Any, sink: TensorSink, path: tuple[str, ...] = ()) -> Any:
    """``value`` as JSON-ready data; tensors go to ``sink(path, tensor)``, which returns their reference."""
    if isinstance(value, np.generic):  # first: np.float64 is a float, np.int64 may pass as an int
        return {"__numpy__": [value.dtype.str, encode(value.item(), sink, path)]}
    if isinstance(value, enum.Enum):  # before int and str: IntEnum and StrEnum members come back as members
        if _resolve(_qualified_name(type(value)), "__enum__") is not type(value):
            return _unencodable(value, path)
        return {"__enum__": [_qualified_name(type(value)), encode(value.value, sink, (*path, "value"))]}
    if isinstance(value, Unsaved):
        return {"__unencodable__": repr(value)}
    if value is None or isinstance(value, (bool, str)):
        return value
    omegaconf = sys.modules.get("omegaconf")  # a DictConfig exists only where omegaconf is imported
    if omegaconf is not None and isinstance(value, (omegaconf.DictConfig, omegaconf.ListConfig)):
        return {"__omegaconf__": encode(omegaconf.OmegaConf.to_container(value, resolve=False), sink, path)}
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized or value.device.type == "meta":
            return _unencodable(value, path)
        return {"__tensor__": sink(path, value)}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc":
            return _unencodable(value, path)
        return {"__ndarray__": sink(path, torch.from_numpy(np.ascontiguousarray(value)))}
    if isinstance(value, OrderedDict):
        return {"__odict__": [[encode(k, sink, (*path, f"key{i}")), encode(v, sink, (*path, str(k)))]
                              for i, (k, v) in enumerate(value.items())]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not _TAGS.intersection(value):
            return {k: encode(v, sink, (*path, k)) for k, v in value.items()}
        return {"__dict__": [[encode(k, sink, (*path, f"key{i}")), encode(v, sink, (*path, str(k)))]
                             for i, (k, v) in enumerate(value.items())]}
    if isinstance(value, list):
        return [encode(v, sink, (*path, str(i))) for i, v in enumerate(value)]
    if isinstance(value, torch.Size):
        return {"__size__": list(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, sink, (*path, str(i))) for i, v in enumerate(value)]}
    if isinstance(value, (set, frozenset)):
        try:
            items = sorted(value)
        except TypeError:
            items = list(value)
        return {"__set__": [encode(v, sink, (*path, str(i))) for i, v in enumerate(items)]}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, pathlib.PurePath):
        return {"__path__": str(value)}
    if isinstance(value, argparse.Namespace):
        return {"__namespace__": encode(vars(value), sink, path)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_dataclass(value, sink, path)
    return _unencodable(value, path)


def _encode_dataclass(value: Any, sink: TensorSink, path: tuple[str, ...]) -> Any:
    """Its ``init`` fields by name, when they rebuild it: no non-init field, the class resolvable by name."""
    cls = type(value)
    fields = dataclasses.fields(value)
    if any(not f.init for f in fields) or _resolve(_qualified_name(cls), "__dataclass__") is not cls:
        return _unencodable(value, path)
    return {"__dataclass__": [_qualified_name(cls),
                              {f.name: encode(getattr(value, f.name), sink, (*path, f.name)) for f in fields}]}


def decode(data: Any, source: TensorSource) -> Any:
    """Inverse of :func:`encode`; tensors come from ``source(reference)``."""
    if isinstance(data, list):
        return [decode(v, source) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, body), = data.items()
        if tag in _TAGS:
            return _decode_tagged(tag, body, source)
    return {k: decode(v, source) for k, v in data.items()}


def _decode_tagged(tag: str, body: Any, source: TensorSource) -> Any:
    if tag == "__tensor__":
        return source(body)
    if tag == "__ndarray__":
        return source(body).numpy()
    if tag == "__float__":
        return float(body)
    if tag == "__tuple__":
        return tuple(decode(v, source) for v in body)
    if tag == "__set__":
        return {decode(v, source) for v in body}
    if tag == "__dict__":
        return {decode(k, source): decode(v, source) for k, v in body}
    if tag == "__odict__":
        return OrderedDict((decode(k, source), decode(v, source)) for k, v in body)
    if tag == "__size__":
        return torch.Size(body)
    if tag == "__numpy__":
        dtype, value = body
        return np.dtype(dtype).type(decode(value, source))
    if tag == "__bytes__":
        return base64.b64decode(body)
    if tag == "__dtype__":
        dtype = getattr(torch, body, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {body!r}")
        return dtype
    if tag == "__device__":
        return torch.device(body)
    if tag == "__path__":
        return pathlib.Path(body)
    if tag == "__namespace__":
        return argparse.Namespace(**decode(body, source))
    if tag == "__omegaconf__":
        try:
            from omegaconf import OmegaConf
        except ImportError:
            return Unsaved(f"<an OmegaConf config; install omegaconf to load it: {repr(body)[:200]}>")
        return OmegaConf.create(decode(body, source))
    if tag in ("__enum__", "__dataclass__"):
        name, value = body
        cls = _resolve(name, tag)
        if cls is None:
            return Unsaved(f"<{name}: its module is not imported in this process (import it before loading), or "
                           f"it is no {'Enum' if tag == '__enum__' else 'dataclass'}>")
        decoded = decode(value, source)
        try:
            return cls(decoded) if tag == "__enum__" else cls(**decoded)
        except Exception as e:  # noqa: BLE001 - the class changed since the save (a member or field renamed...)
            return Unsaved(f"<{name} cannot be rebuilt from {decoded!r}: {type(e).__name__}: {e}>")
    return Unsaved(body)  # __unencodable__


def _unencodable(value: Any, path: tuple[str, ...]) -> dict[str, str]:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    text = repr(value)
    if len(text) > 200:
        text = text[:197] + "..."
    warnings.warn(f"checkpoint{''.join(f'[{p!r}]' for p in path)} holds a {kind}, which has no pickle-free "
                  f"encoding; it is saved as a readable description and loads as a placeholder that raises when used",
                  CheckpointWarning, stacklevel=3)
    return {"__unencodable__": f"<unsaved {kind}: {text}>"}
