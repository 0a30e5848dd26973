"""The one plan object of a sharing save (:class:`SharedFrozen`, decided by ``lightning_ort_ckpt._sharing``): what it
shares, the link the store makes for it, the check the writer runs before the commit, and what it put in ``.data``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ...errors import CheckpointSaveError
from .. import _checksums
from ._links import Identity, identity, link_into


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

    def link(self, tmp: str) -> bool:
        """Make ``tmp`` (the new ``.data``'s temporary name) a clone or hard link of ``link_from`` if it is still
        the inode ``identity``; False, nothing left behind, where it is not or no link can be made here. The store
        calls it (``Store.writing``'s ``link_data``), knowing nothing else of sharing."""
        assert self.link_from is not None and self.identity is not None
        return link_into(self.link_from, self.identity, tmp)

    def rehash(self, name: str, key: str | None) -> bool:
        """Whether the writer hashes the linked tensor ``name`` (checksum key ``key``) again: unless the caller
        trusts it and its digest was recorded."""
        return name not in self.trusted or key not in self.digests

    def carried_out(self, linked: list[tuple[str, str | None, bool]], digests: dict[str, int], is_link: bool,
                    data: int | None, offsets: dict[str, int], layout: dict[str, tuple[int, tuple[int, ...], int]],
                    path: str) -> SavedData:
        """The end of a sharing save, before its commit (the writer calls it): the linked tensors (name, checksum
        key, whether the writer hashed them again) confirmed to hold the linked bytes, :class:`NotShared` where one
        does not (unless it changed only after the save was asked for); ``digests`` (the hashes just computed) get
        the recorded ones of the linked tensors; a fresh ``.data`` (the open file ``data``) made read-only; and what
        the save put there."""
        changed = []
        for name, key, hashed in linked:
            if key not in digests:
                continue
            if hashed and digests[key] != self.digests.get(key) and (
                    self.changed_since_asked is None or not self.changed_since_asked(name)):
                changed.append(name)
            digests[key] = self.digests.get(key, digests[key])
        if changed:
            raise NotShared(path, changed)
        if data is not None:
            with contextlib.suppress(OSError, NotImplementedError, AttributeError):
                os.fchmod(data, 0o444)  # never written again: see the module's doc
        inode = self.identity if is_link else identity(os.fstat(data))  # type: ignore[arg-type]
        keys = [_checksums.param_key(n) for n in offsets]
        return SavedData(is_link, inode, offsets,  # type: ignore[arg-type]
                         {k: digests[k] for k in keys if k in digests}, layout)


@dataclass(frozen=True)
class SavedData:
    """What a sharing save put in ``.data``: whether it linked, the inode, each tensor's offset and digest (empty
    digests when checksums are off), and each tensor's ``(type code, dims, bytes)`` (what :func:`verify_data` needs
    to hash it again from the file)."""

    linked: bool
    identity: Identity
    offsets: dict[str, int]
    digests: dict[str, int]
    layout: dict[str, tuple[int, tuple[int, ...], int]] = field(default_factory=dict)


class NotShared(CheckpointSaveError):
    """The linked ``.data`` cannot be used: no link could be made (``names`` empty), or the tensors ``names`` no
    longer have the bytes they have there (changed without a version counter seeing it). Nothing was committed:
    save again with a fresh ``.data``."""

    def __init__(self, path: str, names: list[str], why: str = "") -> None:
        why = why or (f"frozen tensor {names[0]!r} ({len(names)} in all) changed although its version did not"
                      if names else "the shared .data file cannot be linked here")
        super().__init__(why, path)
        self.names = names


class SharedTooLarge(NotShared):
    """Everything but the shared frozen tensors kept inline would pass the FlatBuffers 2 GiB limit: the plan cannot
    be carried out. Nothing was written; the caller saves as ``external_data="auto"`` does without sharing."""

    def __init__(self, path: str) -> None:
        super().__init__(path, [], "the checkpoint would pass 2 GiB with everything but the shared frozen tensors "
                                   "inline")
