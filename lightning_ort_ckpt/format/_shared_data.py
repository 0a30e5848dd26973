"""A ``.data`` file of frozen tensors that several checkpoints share by hard link.

ORT reads each external tensor from ``<checkpoint path>.data`` at the tensor's own ``external_data_offset``; nothing
else ties a file to its ``.data`` (no name, size or hash inside). So when a save finds its frozen tensors unchanged
since the previous save, its ``.data`` can be a second name (a hard link) of the previous save's ``.data``: the new
checkpoint's main file points its frozen tensors at the same offsets, and only the main file (trainable parameters,
optimizer state, changed buffers, metadata) is written. Every file stays whole: deleting or replacing one name of a
shared ``.data`` leaves the inode to the others. A shared ``.data`` is never opened for writing again; it is made
read-only when written, so that ONNX Runtime's own ``save_checkpoint`` to such a path fails instead of changing the
file under the other checkpoints (a process running as root is not stopped by the mode: see docs/format.md).

This module says what a save shares (:class:`SharedFrozen`) and what it wrote (:class:`SavedData`); deciding which
tensors are unchanged is the caller's (``lightning_ort_ckpt._sharing``); planning and streaming are the writer's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import CheckpointSaveError

Identity = tuple[int, int, int, int]
"""A ``.data`` file as ``(st_dev, st_ino, st_size, st_mtime_ns)``: the inode that a link must reach. The size and
modification time (which links, renames and mode changes leave alone) tell a reused inode number from ours."""


@dataclass(frozen=True)
class SharedFrozen:
    """The frozen tensors a save keeps in ``.data``.

    Without ``link_from``, a fresh ``.data`` holding ``names`` (sorted, aligned as ORT aligns) is written, read-only.
    With it, ``.data`` is a hard link to ``link_from``, which must still be the inode ``identity``; ``names`` map to
    their offsets there and ``digests`` (checksum key -> XXH3-64) to what the tensors' bytes hashed to when it was
    written. Before the commit the writer hashes the tensors again (while it writes the rest), except those in
    ``trusted`` (whose recorded digests are taken as they are: the caller vouches for them); one whose bytes
    differ raises :class:`NotShared` (nothing is committed), unless ``changed_since_asked`` says it changed only
    after the save was asked for (an asynchronous save reading the live tensor: the linked bytes are then the right
    ones). Where the link cannot be made (another file system, no hard links) it raises :class:`NotShared` before
    writing anything. Either way the caller saves again with a :meth:`fresh` one.
    """

    names: dict[str, int]
    link_from: str | None = None
    identity: Identity | None = None
    digests: dict[str, int] = field(default_factory=dict)
    trusted: frozenset[str] = frozenset()
    changed_since_asked: Callable[[str], bool] | None = None

    @classmethod
    def fresh(cls, names: Iterable[str]) -> SharedFrozen:
        """The tensors ``names``, written to a fresh ``.data``."""
        return cls({n: -1 for n in names})


@dataclass(frozen=True)
class SavedData:
    """What a sharing save put in ``.data``: whether it linked, the inode, and each tensor's offset and digest
    (empty digests when checksums are off)."""

    linked: bool
    identity: Identity
    offsets: dict[str, int]
    digests: dict[str, int]


class NotShared(CheckpointSaveError):
    """The linked ``.data`` cannot be used: no link could be made (``names`` empty), or the tensors ``names`` no
    longer have the bytes they have there (changed without a version counter seeing it). Nothing was committed:
    save again with a fresh ``.data``."""

    def __init__(self, path: str, names: list[str]) -> None:
        why = (f"frozen tensor {names[0]!r} ({len(names)} in all) changed although its version did not" if names
               else "the shared .data file cannot be linked here")
        super().__init__(why, path)
        self.names = names


def identity(st: os.stat_result) -> Identity:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def link_into(source: str, expected: Identity, tmp: str) -> bool:
    """Hard-link ``source`` to the new name ``tmp`` if ``source`` is still the inode ``expected``; False (nothing
    left behind) where it is not or no link can be made (``EXDEV``: another file system; ``EPERM``: no hard links
    there)."""
    try:
        os.link(source, tmp, follow_symlinks=False)
    except (OSError, NotImplementedError):
        return False
    with contextlib.suppress(OSError):
        if identity(os.stat(tmp, follow_symlinks=False)) == expected:
            return True
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return False
