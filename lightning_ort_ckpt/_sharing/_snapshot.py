"""What torch says of the frozen tensors of one save call: which are the live module's own, and which are unchanged
since the previous call (the very object, its memory and its version counter)."""

from __future__ import annotations

import weakref
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from .._translation._torch_compat import version_counter
from ..errors import CheckpointSaveError
from ..format import CheckpointContents

Seen = tuple[weakref.ref[torch.Tensor], tuple[Any, ...]]
"""A live tensor, held weakly, and its state (:func:`state`) when it was looked at."""


def state(t: torch.Tensor) -> tuple[Any, ...]:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, version_counter(t)


@dataclass
class Snapshot:
    """The frozen tensors of one save call that may be shared, as they were at the call (training thread)."""

    directory: str
    live: dict[str, Seen]
    params: set[str]  # the ones that are parameters (frozen ones): no forward pass changes them
    unchanged: set[str] = field(default_factory=set)  # also unchanged since the previous save call
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the live tensors of the call, held until its
    # save is written: a module that replaces one meanwhile (async) must not make it look like another tensor

    @property
    def keep(self) -> set[str]:
        """Frozen parameters an asynchronous save need not copy: unchanged since the previous call, which most likely
        shares them. Buffers are always copied: a forward pass may change them without a version bump."""
        return self.unchanged & self.params

    def still_live(self, name: str) -> bool:
        """Whether the live tensor ``name`` is still what it was at the save call."""
        ref, then = self.live[name]
        now = ref()
        return now is not None and state(now) == then

    def still(self, name: str, then: Seen | None) -> bool:
        """Whether ``name`` is the tensor it was in the snapshot ``then`` (same object, memory and version)."""
        now, held = self.live.get(name), self.tensors.get(name)
        if held is None and now is not None:
            held = now[0]()
        return then is not None and now is not None and then[0]() is held is not None and then[1] == now[1]


def tensor(ck: CheckpointContents, name: str) -> torch.Tensor:
    """Frozen tensor ``name`` of ``ck``, one the snapshot took (only torch tensors of the module take part)."""
    t = ck.frozen[name]
    assert isinstance(t, torch.Tensor), name
    return t


def nbytes(ck: CheckpointContents, names: Collection[str]) -> int:
    """The bytes of the frozen tensors ``names`` of ``ck``."""
    return sum(tensor(ck, n).numel() * tensor(ck, n).element_size() for n in names)


def copy_unchanged(t: torch.Tensor, snap: Snapshot, name: str, path: str) -> torch.Tensor:
    """A copy of the live tensor ``t`` an asynchronous save kept uncopied, made on the writer thread; it must still
    be what it was at the save call."""
    copy = t.detach().to("cpu", copy=True)
    ref, then = snap.live[name]
    if ref() is None or state(ref()) != then:  # type: ignore[arg-type]
        raise CheckpointSaveError(f"frozen tensor {name!r} was changed in place while its asynchronous save was "
                                  "being written; the file would mix two training steps, so it was not written", path)
    return copy
