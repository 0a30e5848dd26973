"""Which checkpoint files a save lets go: a small pure rule, as Orbax keeps its retention policies.

``OrtCheckpoint`` keeps Lightning's top k by metric (``ModelCheckpoint`` decides those and hands over the files it
drops), the newest ``keep_newest`` files it saved, and whatever is protected: the best and last files, the target
of a ``last`` link, the file a user resumed from. Everything else that is waiting goes, oldest name first.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any


def retain(saved: Sequence[str], waiting: Collection[str], protected: Collection[str],
           keep_newest: int | None) -> tuple[list[str], set[str]]:
    """``(delete now, still waiting)``.

    ``saved``: the files saved for top-k or periodically, oldest first; ``waiting``: files dropped earlier but not
    deleted yet (protected then); ``protected``: files that must stay now; ``keep_newest``: with it, every saved file
    but the newest ``keep_newest`` waits too. A waiting file that is protected now waits on.
    """
    waiting = set(waiting)
    protected = set(protected)
    if keep_newest is not None:
        if keep_newest < 1:
            raise ValueError(f"keep_newest must be None or >= 1, got {keep_newest}")
        protected.update(saved[-keep_newest:])
        waiting.update(saved[:-keep_newest])
    delete = sorted(waiting - protected)
    return delete, waiting - set(delete)


class Ledger:
    """The files a callback saved and the ones waiting to go: the state :func:`retain` decides on, kept together.

    ``saved``: the files saved for top-k or periodically, oldest first (part of each file's callback state, so that a
    run resumed from it can still rotate them out); ``waiting``: files let go but not deleted yet; ``last_unranked``:
    the newest file saved unranked (without ``keep_newest`` only that one is kept).
    """

    def __init__(self, keep_newest: int | None) -> None:
        self.keep_newest = keep_newest
        self.saved: list[str] = []
        self.waiting: set[str] = set()
        self.last_unranked = ""

    def saving(self, path: str) -> None:
        """``path`` is being saved: it is the newest, and no longer waiting to go."""
        if path in self.saved:
            self.saved.remove(path)
        self.saved.append(path)
        self.waiting.discard(path)

    def saving_unranked(self, path: str) -> None:
        """``path`` is saved unranked: without ``keep_newest``, the previous unranked file goes."""
        previous, self.last_unranked = self.last_unranked, path
        if self.keep_newest is None and previous and previous != path:
            self.waiting.add(previous)

    def release(self, protected: Collection[str]) -> list[str]:
        """The files to delete now (forgotten here); the others wait on."""
        delete, self.waiting = retain(self.saved, self.waiting, protected, self.keep_newest)
        self.saved = [p for p in self.saved if p not in delete]
        return delete

    def restore(self, state: dict[str, Any], kept: Collection[str], ours: Callable[[str], bool],
                exists: Callable[[str], bool]) -> list[str]:
        """Take the files a checkpoint's callback ``state`` lists, only those that are ``ours`` (checkpoints of
        this directory: paths restored from a file are trusted no further; saved ones that still exist); returns
        the names it (and ``kept``, the ranking it restored) gives that are not ours, sorted."""
        saved, unranked = state.get("saved", []), state.get("last_unranked", "")
        self.saved = [p for p in saved if ours(p) and exists(p)]
        self.last_unranked = unranked if ours(unranked) else ""
        return sorted({p for p in (*kept, *saved, unranked) if p and not ours(p)})
