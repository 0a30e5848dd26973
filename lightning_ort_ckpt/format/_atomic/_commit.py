"""Committing changes to a directory of checkpoints on the local disk, each whole or not at all: a save's temporaries
written beside the target under hidden names, fsynced and renamed into place under the directory's lock (``.data``
first); a removal and a link, committed the same way; and the recovery of a commit a writer died in.

A checkpoint with a ``.data`` companion is two files that cannot be renamed together; a small journal
(``<path>.commit``), written durably before the first rename, names the pair of temporaries and marks the commit in
progress. Only writers act on it (:func:`recover_locked`, under the directory's lock: the next save of the path, a
removal, or :func:`repair`), renaming nothing but the journal's two temporaries, and only when their names follow our
pattern. Readers only read it (``_pairs``). New directories are made durable with their parents; a save that gives up
discards its temporaries quietly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from ...errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from .._naming import DATA_SUFFIX, data_path
from ._cleanup import UNLINKER, forget_listing, sweep_stale
from ._lock import WriterLock, fsync_dir
from ._names import check_names_fit, hidden_name, journal_path, temp_name, token, token_of, trash_name

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


@dataclass
class SaveFiles:
    """Open temporary files of a save in progress; ``data`` is None when the checkpoint has no external data."""

    main: BinaryIO
    data: BinaryIO | None
    linked: bool = False  # the .data temporary is a hard link to an existing file (see ``shared``): write nothing


@contextlib.contextmanager
def atomic_save(path: str, *, with_data: bool, required_bytes: int,
                link_data: Callable[[str], bool] | None = None) -> Iterator[SaveFiles]:
    """Yield temporary files to write, each from its start and in order (the main one may be a retired file of
    the directory written over: it ends where the writing left it); on a clean exit make them durable and move them
    to ``path``.

    ``link_data`` (the sharing plan's ``link``): called with the new ``.data``'s temporary name, it makes that a link
    to an existing file instead of a file to write, and says whether it could (``SaveFiles.linked``). On any exception before the commit the
    temporary files are removed and whatever was at ``path`` stays as it was.
    """
    target = os.path.abspath(path)
    directory = os.path.dirname(target)
    makedirs_durably(directory)
    check_names_fit(target, with_data)
    sweep_stale(directory)
    tag = token()
    tmp_main = hidden_name(target, tag, "tmp")
    tmp_data = hidden_name(data_path(target), tag, "tmp") if with_data else None
    reused = UNLINKER.take(directory, tmp_main)  # a retired file's pages, written over (``_cleanup``: spares)
    free = shutil.disk_usage(directory).free + (reused or 0)
    if free < required_bytes:
        discard(tmp_main if reused is not None else None)
        raise CheckpointSaveError(
            f"not enough free disk space: the checkpoint needs {required_bytes:,} bytes, {free:,} are free; "
            "nothing was written", path)
    opened: list[BinaryIO] = []
    try:
        opened.append(open(tmp_main, "xb" if reused is None else "r+b", buffering=0))
        linked = tmp_data is not None and link_data is not None and link_data(tmp_data)
        if tmp_data is not None and not linked:
            opened.append(open(tmp_data, "xb", buffering=0))
        yield SaveFiles(opened[0], opened[1] if len(opened) > 1 else None, linked)
        if reused is not None:  # written from its start: what the file held beyond the new bytes goes
            opened[0].truncate(opened[0].tell())
        for f in opened:
            os.fsync(f.fileno())
            f.close()
    except BaseException as e:
        for f in opened:
            f.close()
        discard(tmp_main, tmp_data)
        # e.g. a tensor whose copy fails midway (a meta tensor); the writer words OSErrors (EFBIG, ENOSPC) itself
        if isinstance(e, Exception) and not isinstance(e, (CheckpointError, OSError)):
            raise CheckpointSaveError(f"save failed ({type(e).__name__}: {e}); the previous checkpoint at this "
                                      "path, if any, is unchanged", path) from e
        raise
    commit_locked(target, tmp_main, tmp_data)


def commit_locked(path: str, tmp_main: str, tmp_data: str | None) -> None:
    """Take the directory's lock, complete a dead writer's commit of ``path`` if any, then commit ours."""
    committing = False
    try:
        with WriterLock(os.path.dirname(path)) as lock:
            recover_locked(path, lock)
            committing = True
            _commit(path, tmp_main, tmp_data, lock)
    except BaseException:
        if not committing:
            discard(tmp_main, tmp_data)
        raise


def _commit(path: str, tmp_main: str, tmp_data: str | None, lock: WriterLock) -> None:
    """Move the durable temporaries to ``path`` (and its ``.data``); the caller holds the directory's lock.

    Until the journal is durable a failure removes both temporaries (a full disk gets its space back); after it, a
    failure is completed by the next writer, and readers see the pair the journal describes.
    """
    retired: list[str] = []
    journal = journal_path(path)
    try:
        if tmp_data is None:
            try:
                retired += retire(path)
                os.replace(tmp_main, path)
            except BaseException:
                discard(tmp_main)
                raise
            lock.fsync()
            if os.path.lexists(data_path(path)):  # the replaced checkpoint's external data is now stale
                trash = trash_name(data_path(path))
                os.replace(data_path(path), trash)
                retired.append(trash)
            return
        try:
            _write_durably(journal, journal_record(tmp_main, tmp_data), lock)
        except BaseException:
            discard(tmp_main, tmp_data)
            raise
        try:
            retired += retire(data_path(path))
            replace(tmp_data, data_path(path))
            retired += retire(path)
            os.replace(tmp_main, path)
            lock.fsync()
            os.unlink(journal)
        except OSError as e:
            raise CheckpointSaveError(f"the save failed between its renames ({e.strerror or e}); readers see the "
                                      "old or the new checkpoint whole, and the next save of this path completes "
                                      "the new one", path) from e
    finally:
        for trash in retired:
            UNLINKER.put(trash)


def _write_durably(path: str, data: bytes, lock: WriterLock) -> None:
    tmp = temp_name(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    lock.fsync()


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


def discard(*paths: str | None) -> None:
    """Unlink each of ``paths`` that exists (None: nothing), quietly: a failed save's temporaries."""
    for p in paths:
        if p is not None:
            with contextlib.suppress(OSError):
                os.unlink(p)


def makedirs_durably(directory: str) -> None:
    """``os.makedirs``, and each directory it creates is made durable by an fsync of its parent."""
    missing = []
    d = directory
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
        fsync_dir(os.path.dirname(d))
