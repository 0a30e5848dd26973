"""Removing a checkpoint (its ``.data`` too, or a checkpoint folder whole) and linking one to another name, both
committed under the directory's lock like a save, so that no reader ever finds half of either."""

from __future__ import annotations

import os

from ._durable import discard
from ._journal import recover_locked
from ._lock import WriterLock
from .._naming import data_path
from ._names import check_names_fit, hidden_name, token, trash_name
from ._saving import commit_locked
from ._unlinker import UNLINKER


def remove(path: str) -> None:
    """Delete a checkpoint together with its ``.data`` file, or a checkpoint folder (a sharded checkpoint) whole;
    the blocks are freed later.

    All or nothing for a reader: the ``.ckpt`` goes first (renamed to a hidden name), so no reader ever finds a
    ``.ckpt`` without its ``.data``; a folder is renamed in one step, so no reader finds part of it. The renames are
    durable when this returns (a crash cannot bring the checkpoint back); what they hid is deleted on the background
    thread, or, after a crash, swept by the next save in the directory. A commit a dead writer left pending is
    completed first, so its new ``.ckpt`` cannot reappear.
    """
    path = os.path.abspath(path)
    hidden: list[str] = []
    with WriterLock(os.path.dirname(path)) as lock:
        recover_locked(path, lock)
        for victim in (path, data_path(path)):
            if os.path.lexists(victim):
                trash = trash_name(victim)
                os.replace(victim, trash)
                hidden.append(trash)
        if hidden:
            lock.fsync()
    for trash in hidden:
        UNLINKER.put(trash)


def link(target: str, linkpath: str) -> None:
    """Point ``linkpath`` at ``target`` (a relative symbolic link), and ``linkpath.data`` at its ``.data`` if any.

    The links are made under temporary names and committed like a save (journal included), so ``linkpath`` always
    resolves and our readers never pair one target's ``.ckpt`` with another's ``.data``.
    """
    linkpath = os.path.abspath(linkpath)
    directory = os.path.dirname(linkpath)
    with_data = os.path.exists(data_path(target))
    check_names_fit(linkpath, with_data)
    tag = token()
    tmp_main = hidden_name(linkpath, tag, "tmp")
    tmp_data = hidden_name(data_path(linkpath), tag, "tmp") if with_data else None
    try:
        for source, tmp in ((target, tmp_main), (data_path(target), tmp_data)):
            if tmp is not None:
                os.symlink(os.path.relpath(os.path.abspath(source), directory), tmp)
    except BaseException:
        discard(tmp_main, tmp_data)
        raise
    commit_locked(linkpath, tmp_main, tmp_data)
