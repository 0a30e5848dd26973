"""The commit journal of a checkpoint with external data, and the recovery of a commit a writer died in.

A checkpoint with a ``.data`` companion is two files that cannot be renamed together; a small journal
(``<path>.commit``), written durably before the first rename, names the pair of temporaries and marks the commit in
progress. Only writers act on it (:func:`recover_locked`, under the directory's lock: the next save of the path, a
removal, or :func:`repair`), renaming nothing but the journal's two temporaries, and only when their names follow our
pattern. Readers only read it (``_pairs``).
"""

from __future__ import annotations

import json
import os
import stat

from ...errors import CheckpointError, CorruptCheckpointError
from ._durable import discard
from ._lock import WriterLock
from .._naming import DATA_SUFFIX, data_path
from ._names import journal_path, token_of, trash_name
from ._sweep import forget_listing, sweep_stale
from ._unlinker import UNLINKER

NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO must not hang


def journal_record(tmp_main: str, tmp_data: str) -> bytes:
    """The journal's text: the two temporaries' names (in the checkpoint's directory)."""
    return json.dumps({"checkpoint": os.path.basename(tmp_main), "data": os.path.basename(tmp_data)}).encode()


def read_journal(path: str) -> tuple[str, str] | None:
    """The two temporaries a pending commit of ``path`` names, or None: no journal, or one that is not ours (its
    names do not follow our temporary pattern for ``path``), which nothing acts on."""
    journal = journal_path(path)
    try:
        fd = os.open(journal, os.O_RDONLY | NONBLOCK)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read the commit journal {journal}: {e.strerror or e}", path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device is not ours, and must not hang us
            return None
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        names = json.loads(raw)
        main, data = names["checkpoint"], names["data"]
    except (ValueError, KeyError, TypeError):
        return None
    base = os.path.basename(path)
    tag = token_of(main, base) if isinstance(main, str) else None
    if tag is None or not isinstance(data, str) or token_of(data, base + DATA_SUFFIX) != tag:
        return None
    directory = os.path.dirname(path)
    return os.path.join(directory, main), os.path.join(directory, data)


def retire(path: str) -> list[str]:
    """Give ``path`` a second name so that replacing it does not free its blocks on the caller's thread."""
    if not os.path.lexists(path) or os.path.islink(path):  # replacing a symbolic link frees nothing
        return []
    trash = trash_name(path)
    try:
        os.link(path, trash, follow_symlinks=False)
    except (OSError, NotImplementedError):  # no hard links here: let the rename free the blocks
        return []
    return [trash]


def replace(source: str, target: str) -> None:
    """``os.replace``, also where both are names of one inode (a ``.data`` linked to the one it replaces): POSIX
    rename then does nothing, so the temporary name is removed here."""
    os.replace(source, target)
    if os.path.lexists(source):
        os.unlink(source)


def recover_locked(path: str, lock: WriterLock) -> bool:
    """Complete the commit a dead writer left half done (the caller holds the lock, so no live writer owns it)."""
    names = read_journal(path)
    if names is None:
        return False
    tmp_main, tmp_data = names
    retired: list[str] = []
    try:
        if os.path.lexists(tmp_data):
            if not os.path.lexists(tmp_main):  # not a state our commit leaves: keep the old pair
                discard(tmp_data)
            else:
                retired += retire(data_path(path))
                replace(tmp_data, data_path(path))
        if os.path.lexists(tmp_main):
            retired += retire(path)
            os.replace(tmp_main, path)
        lock.fsync()
        os.unlink(journal_path(path))
    except OSError as e:
        raise CorruptCheckpointError(f"a save was interrupted while replacing this checkpoint and its .data file, "
                                     f"and completing it failed ({e}); retry with write access to the directory",
                                     path) from None
    finally:
        for trash in retired:
            UNLINKER.put(trash)
    forget_listing(os.path.dirname(path))  # a writer died here: what else it left, the next save's listing finds
    return True


def repair(path: str | os.PathLike[str]) -> bool:
    """Complete an interrupted commit of ``path`` now, as its next save would; True when there was one.

    Only the two temporary files a journal of ours names are renamed; a journal that names anything else is left
    alone. Leftovers of dead saves in the directory are queued for deletion too.
    """
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    with WriterLock(directory) as lock:
        done = recover_locked(path, lock)
    sweep_stale(directory, relist=True)
    return done
