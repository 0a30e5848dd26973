"""What a callback may delete, and when (Orbax's preservation policy), around the pure rule of ``_retention``.

``OrtCheckpoint`` hands every file it saves or lets go to one :class:`Preservation`; it says which files go now.
Kept: Lightning's top k, the best and last files, the target of a ``last`` link until the link has moved on, a file
the user resumed from (not the one ``ckpt_path="last"`` resolved to: that one rotates as in the uninterrupted run),
and anything that is not a checkpoint inside ``dirpath`` (``_registry.belongs``: paths restored from a file are
trusted no further).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Collection
from typing import Any

from .._restore import _registry
from .._restore._resume import Resumption
from ._retention import Ledger
from ..errors import CheckpointWarning
from ..format._store import Store

StoreOf = Callable[[str], Store]
"""The store of a path, with the callback's plugin options."""


class Preservation:
    """The files of one callback: its :class:`~._retention.Ledger`, the target its ``last`` link points to, and
    what "last" resolved to (``resumption``)."""

    def __init__(self, keep_newest: int | None, resumption: Resumption, extension: str) -> None:
        self.ledger = Ledger(keep_newest)
        self.resumption = resumption
        self.extension = extension
        self.link_target: str | None = None  # what the last link points to once queued work is done

    def confined(self, dirpath: str | os.PathLike[str] | None, path: str, store_of: StoreOf) -> bool:
        """Whether the callback may delete ``path`` or link there or to it."""
        return dirpath is not None and _registry.belongs(os.fspath(dirpath), path, self.extension, store_of)

    def resumed_last(self, path: str, store_of: StoreOf) -> bool:
        """Whether ``path`` is what ``ckpt_path="last"`` resolved to: one of ours, rotating as usual."""
        return self.resumption.is_last(path, lambda p: store_of(p).absolute(p))

    def linked(self, target: str, linkpath: str, store_of: StoreOf) -> None:
        """The last link at ``linkpath`` now points to ``target`` (a copy, not a link, on a store without them)."""
        self.link_target = target if store_of(linkpath).local else None

    def release(self, kept: Collection[str], last: str, resumed: str | None, store_of: StoreOf) -> list[str]:
        """The files to delete now: waiting ones that nothing keeps (``kept``: Lightning's top k and best; ``last``
        the last file; ``resumed``: the Trainer's ``ckpt_path``)."""
        keep = {*kept, last}
        if self.link_target is None and last:
            self.link_target = store_of(last).link_target(last)
        if self.link_target:  # never leave "last" dangling: its target goes only once the link has moved on
            keep.add(self.link_target)
        if resumed and not self.resumed_last(resumed, store_of):  # a file the user chose: never deleted
            keep.add(resumed)
        return self.ledger.release(keep)

    def deletable(self, dirpath: str | os.PathLike[str] | None, previous: str, current: str, store_of: StoreOf,
                  lightnings_test: Callable[[], bool]) -> bool:
        """Lightning's test (``lightnings_test``: not the current file, inside ``dirpath``, not the file resumed
        from), with ``..`` and links resolved first; the file "last" resolved to rotates as in the uninterrupted
        run."""
        if not self.confined(dirpath, previous, store_of):
            return False
        if self.resumed_last(previous, store_of):
            store = store_of(previous)
            return store.absolute(previous) != store.absolute(current)
        return lightnings_test()

    def take_half(self, entries: list[_registry.Entry]) -> None:
        """Folders of saves that did not finish (found by "last"): deleted once the next save is stored."""
        half = sorted(e.path for e in _registry.half(entries))
        if half:
            self.ledger.waiting.update(half)
            warnings.warn(f"{', '.join(half)}: checkpoint folder(s) without {_registry.FOLDER_COMMIT_NAME} (a save "
                          "that did not finish): not resumed from, and deleted after the next save", CheckpointWarning,
                          stacklevel=4)

    def state_dict(self) -> dict[str, Any]:
        """What each file's callback state lists, so that a run resumed from it can still rotate the files out."""
        return {"saved": list(self.ledger.saved), "last_unranked": self.ledger.last_unranked}

    def restore(self, state: dict[str, Any], kept: Collection[str], dirpath: str | os.PathLike[str] | None,
                store_of: StoreOf) -> None:
        """Take the files a checkpoint's callback ``state`` lists that are checkpoints of ``dirpath``; warn of the
        others (and of those in ``kept``, the ranking Lightning restored): they are never deleted or linked."""
        outside = self.ledger.restore(state, kept, lambda p: self.confined(dirpath, p, store_of),
                                      lambda p: store_of(p).exists(p))
        if outside:
            warnings.warn(f"the checkpoint's callback state names files that are not checkpoints inside dirpath "
                          f"{os.fspath(dirpath) if dirpath is not None else None!r}: {', '.join(outside)}; they will "
                          "never be deleted or linked", CheckpointWarning, stacklevel=4)
