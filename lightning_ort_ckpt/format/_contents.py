"""The in-memory checkpoint: what an ODTC file holds, with no file or framework concerns.

Tensors may be torch tensors or numpy arrays (any device, any layout; the writer stages them). A STRING tensor is a
numpy array of ``str``. The field names follow ORT: ``trainable`` is ORT's ``requires_grad_params``, ``frozen`` its
``frozen_params`` (buffers and parameters without gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from ._dtypes import DataType

if TYPE_CHECKING:  # this layer imports no torch at run time; type checkers see the real classes
    import torch

Tensor = Union["torch.Tensor", np.ndarray, "StoredAs", "Deferred"]
"""What a checkpoint's tensor may be: a torch tensor, a numpy array, one stored as another type, or one read later."""
PropertyValue = Union[int, float, str]



@dataclass(frozen=True)
class StoredAs:
    """A tensor to be stored as another data type, converted chunk by chunk while it streams: saving a bfloat16
    state as the float32 ORT loads costs one bounded chunk, not a whole float32 copy. ``dtype`` must hold every
    value of the tensor exactly (float16, bfloat16 and float8 as FLOAT); the writer does not check."""

    tensor: Any
    dtype: DataType


@dataclass(frozen=True)
class Deferred:
    """A tensor read only when the writer streams it, and let go right after: a consolidation assembles each tensor
    from the shards of a sharded checkpoint this way, so the save holds one tensor at a time, not the whole state.
    ``load()`` returns a torch tensor or numpy array of ``dtype`` and ``shape`` (it may run more than once: a store
    that hashes before streaming reads every tensor twice)."""

    dtype: DataType
    shape: tuple[int, ...]
    load: Callable[[], Any]


GROUP_ZERO = "group0"
"""The only optimizer group ORT's ``Optimizer`` uses."""


@dataclass
class OptimizerGroup:
    """One optimizer group: its completed step count, initial learning rate and per-parameter momentum tensors.

    ``states`` maps parameter name -> momentum name -> tensor. ORT's AdamW reads ``momentum0`` (first moment) and
    ``momentum1`` (second moment); its SGD reads ``momentum0``. ``initial_learning_rate`` is stored as float32.
    """

    step: int = 0
    initial_learning_rate: float = 0.0
    states: dict[str, dict[str, Tensor]] = field(default_factory=dict)


@dataclass
class CheckpointContents:
    """Everything an ODTC file can hold.

    ``properties`` values are int (int64), float (stored as float32, as in ORT) or str. ``nominal`` marks a
    checkpoint that records only names, dtypes and the trainable/frozen split, without data.
    """

    trainable: dict[str, Tensor] = field(default_factory=dict)
    frozen: dict[str, Tensor] = field(default_factory=dict)
    optimizer_groups: dict[str, OptimizerGroup] = field(default_factory=dict)
    properties: dict[str, PropertyValue] = field(default_factory=dict)
    nominal: bool = False
