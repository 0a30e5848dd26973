"""Typed, pickle-free encoding of arbitrary checkpoint values as JSON plus tensors.

Lightning checkpoints hold nested dicts, lists and tuples of ints, floats, strings, None and tensors. ORT's property
bag holds only flat int64, float32 and string values, so the values are encoded as one JSON document (stored as a
string property) and every tensor, wherever it is nested, is handed to a *tensor sink* that stores it as a real
tensor in the file and returns a JSON reference to it. Decoding reverses this with a *tensor source*.

JSON values stand for themselves, with these exceptions, each a one-key object whose key is a tag:

==================  ================================================================================
``{"__tensor__": r}``   a torch tensor; ``r`` is the sink's reference (see ``translation.lightning``)
``{"__ndarray__": r}``  a numpy array stored as a tensor
``{"__float__": s}``    a float JSON cannot spell: ``"nan"``, ``"inf"``, ``"-inf"`` (finite floats are JSON
                        numbers with Python's shortest round-trip repr, so float64 values come back exactly)
``{"__tuple__": [...]}``  a tuple (a namedtuple comes back as a plain tuple); ``{"__set__": [...]}`` a set;
                        ``{"__size__": [...]}`` a ``torch.Size``
``{"__dict__": [[k, v], ...]}``  a dict whose keys are not all strings, or that uses a tag as a key;
                        ``{"__odict__": [[k, v], ...]}`` an OrderedDict (other dict subclasses come back as dicts)
``{"__numpy__": [dtype, v]}``  a numpy scalar (an IntEnum is saved as its int)
``{"__bytes__": b64}``  bytes; ``{"__dtype__": "float32"}`` a torch dtype; ``{"__device__": "cpu"}`` a device
``{"__path__": s}``     a pathlib path; ``{"__namespace__": {...}}`` an argparse Namespace
``{"__unencodable__": s}``  a value with no faithful plain form (an ``nn.Module`` hparam, say): saved as a
                        readable description, restored as that string, with a warning naming its key
==================  ================================================================================
"""

from __future__ import annotations

import argparse
import base64
import math
import pathlib
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointWarning

TensorSink = Callable[[tuple[str, ...], torch.Tensor], Any]
TensorSource = Callable[[Any], torch.Tensor]

_TAGS = frozenset({"__tensor__", "__ndarray__", "__float__", "__tuple__", "__set__", "__dict__", "__odict__",
                   "__size__", "__numpy__",
                   "__bytes__", "__dtype__", "__device__", "__path__", "__namespace__", "__unencodable__"})


def encode(value: Any, sink: TensorSink, path: tuple[str, ...] = ()) -> Any:
    """``value`` as JSON-ready data; tensors go to ``sink(path, tensor)``, which returns their reference."""
    if isinstance(value, np.generic):  # first: np.float64 is a float, np.int64 may pass as an int
        return {"__numpy__": [value.dtype.str, encode(value.item(), sink, path)]}
    if value is None or isinstance(value, (bool, str)):
        return value
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
    return _unencodable(value, path)


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
    return body  # __unencodable__: the readable placeholder


def _unencodable(value: Any, path: tuple[str, ...]) -> dict[str, str]:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    text = repr(value)
    if len(text) > 200:
        text = text[:197] + "..."
    warnings.warn(f"checkpoint{''.join(f'[{p!r}]' for p in path)} holds a {kind}, which has no pickle-free "
                  f"encoding; it is saved as a readable description and will load as that string",
                  CheckpointWarning, stacklevel=3)
    return {"__unencodable__": f"<unsaved {kind}: {text}>"}
