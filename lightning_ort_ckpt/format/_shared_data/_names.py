"""The hidden reserve names that keep a shared ``.data``, and the checkpoints that share one."""

from __future__ import annotations

import contextlib
import os
from ._links import Identity, identity




RESERVE_PREFIX = ".ort_ckpt.reserve-"
"""How a reserve's name starts: a hidden second name (a hard link, in the same folder) that keeps a shared ``.data``
whose last checkpoint retention deletes while other checkpoints link another copy (``lightning_ort_ckpt._sharing``).
It ends in neither ``.tmp`` nor ``.old``, so the sweep of leftovers leaves it alone; hidden and not ``*.ckpt``, so no
search for checkpoints (``ckpt_path="last"``, ``sharing_checkpoints``) finds it."""


def is_reserve(path: str) -> bool:
    """Whether ``path`` is a reserve name (:data:`RESERVE_PREFIX`)."""
    return os.path.basename(path).startswith(RESERVE_PREFIX)


def keep_reserve(data: str, expected: Identity) -> str | None:
    """A reserve name for the ``.data`` file ``data`` if it is still the inode ``expected``: a hard link made beside it
    (never opened, so never written through), or the one it has already; None where no link can be made."""
    try:
        st = os.stat(data, follow_symlinks=False)
    except OSError:
        return None
    if identity(st) != expected:
        return None
    name = os.path.join(os.path.dirname(data), f"{RESERVE_PREFIX}{st.st_dev:x}-{st.st_ino}.data")
    try:
        os.link(data, name, follow_symlinks=False)
    except FileExistsError:  # this inode has one already (the name holds the inode: no other file has its number)
        pass
    except (OSError, NotImplementedError):
        return None
    try:
        return name if identity(os.stat(name, follow_symlinks=False)) == expected else None
    except OSError:
        return None


def looked_at(path: str) -> os.stat_result | None:
    """The name ``path`` as it is now, its symbolic link not followed (None where nothing is there): how sharing
    tells a ``.data`` name's inode, change time and link count (``lightning_ort_ckpt._sharing._copies``)."""
    try:
        return os.stat(path, follow_symlinks=False)
    except OSError:
        return None


def drop_name(path: str) -> None:
    """Delete the hidden name ``path`` (a reserve, or a copy written ahead that no save linked); one already gone is
    fine. The inode goes with its last name: a checkpoint's names keep it."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def reserves(directory: str) -> list[str]:
    """The reserve names in ``directory`` (those of an earlier run included)."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        return sorted(e.path for e in entries if e.name.startswith(RESERVE_PREFIX))
    return []


def sharing_checkpoints(path: str, suffix: str = ".ckpt") -> list[str]:
    """The checkpoints (``*<suffix>`` in the folder of ``path``, ``path`` included) whose ``.data`` is the very
    file (inode) ``path``'s is: the ones one damaged shared file takes with it. [] when it has no ``.data``."""
    try:
        mine = os.stat(path + ".data")
    except OSError:
        return []
    directory = os.path.dirname(os.path.abspath(path))
    found = []
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(suffix):
                continue
            with contextlib.suppress(OSError):
                st = os.stat(entry.path + ".data")
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    found.append(entry.path)
    return sorted(found)


def damage_note(path: str, error: str) -> str:
    """For an error of checkpoint ``path`` (its message ``error``) whose damage lies in a ``.data`` file other
    checkpoints share: a sentence naming the file and every checkpoint it takes with it; "" otherwise."""
    data = path + ".data"
    if data not in error:
        return ""
    sharing = sharing_checkpoints(path, os.path.splitext(path)[1] or ".ckpt")
    if len(sharing) < 2:
        return ""
    return (f"{data} is a shared .data (hard links): the {len(sharing)} checkpoints sharing it are damaged with it: "
            f"{', '.join(os.path.basename(p) for p in sharing)} (`ort-ckpt verify --repair` rewrites it from the "
            "other copy where that one holds the damaged tensors intact)")
