"""Sweeping what dead saves left in a directory: temporaries of interrupted saves, and replaced or removed files a
process was killed before unlinking. Only this host's leftovers of a dead process or an earlier boot are certain;
others' (and names of older versions) go only once older than :data:`STALE_AGE_S`, so a shared file system never
loses another machine's save in progress. A process lists a directory once (its first save there); later saves look
again only at the leftovers that had to wait."""

from __future__ import annotations

import os
import threading
import time

from ._names import LEFTOVER, OLD_LEFTOVER, dead
from ._unlinker import UNLINKER

STALE_AGE_S = 7 * 24 * 3600  # leftovers of other hosts, or named as older versions did, go only after this long

_SWEPT_LOCK = threading.Lock()
_WAITING: dict[str, set[str]] = {}  # each directory this process listed -> the leftovers there that had to wait


def sweep_stale(directory: str, *, relist: bool = False) -> None:
    """Queue for deletion what dead saves left in ``directory``.

    The directory is listed once per process (or with ``relist``): a directory of many files costs one listing per
    run, not one per save. Later calls look again only at the leftovers that listing found and had to leave (a live
    writer's, another host's, recent ones of older versions)."""
    now = time.time()
    with _SWEPT_LOCK:
        names = None if relist else _WAITING.get(directory)
        if names is None:
            with os.scandir(directory) as entries:
                names = {e.name for e in entries if LEFTOVER.match(e.name) or OLD_LEFTOVER.match(e.name)}
        _WAITING[directory] = {name for name in names if not _swept(os.path.join(directory, name), now)}


def _swept(path: str, now: float) -> bool:
    """Queue the leftover ``path`` for deletion if its save is certainly dead; True when it is queued or gone."""
    try:
        st = os.lstat(path)
    except OSError:
        return True
    m = LEFTOVER.match(os.path.basename(path))
    gone = dead(m) if m is not None else None
    if gone is None:  # we cannot tell: only by age
        gone = now - max(st.st_mtime, st.st_ctime) > STALE_AGE_S
    if gone:
        UNLINKER.put(path)
    return gone


def forget_listing(directory: str) -> None:
    """Have the next save list ``directory`` again (a writer died there during this run)."""
    with _SWEPT_LOCK:
        _WAITING.pop(directory, None)


def _reset_sweeps() -> None:
    global _SWEPT_LOCK
    _SWEPT_LOCK = threading.Lock()  # a forked child gets the lock as its parent's other threads held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_sweeps)
