"""A save's temporaries and their commit: written beside the target under hidden names, fsynced, and renamed into
place under the directory's lock, ``.data`` first, with the journal (``_journal``) recording a two-file commit."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from ...errors import CheckpointError, CheckpointSaveError
from .._shared_data import Identity, link_into
from ._durable import discard, makedirs_durably
from ._journal import journal_record, recover_locked, replace, retire
from ._lock import WriterLock
from .._naming import data_path
from ._names import check_names_fit, hidden_name, journal_path, temp_name, token, trash_name
from ._sweep import sweep_stale
from ._unlinker import UNLINKER


@dataclass
class SaveFiles:
    """Open temporary files of a save in progress; ``data`` is None when the checkpoint has no external data."""

    main: BinaryIO
    data: BinaryIO | None
    linked: bool = False  # the .data temporary is a hard link to an existing file (see ``shared``): write nothing


@contextlib.contextmanager
def atomic_save(path: str, *, with_data: bool, required_bytes: int,
                link_data: tuple[str, Identity] | None = None) -> Iterator[SaveFiles]:
    """Yield temporary files to write; on a clean exit make them durable and move them to ``path``.

    ``link_data`` (a ``.data`` file and the inode it must be): the new ``.data`` is a hard link to it instead of a
    file to write, when that link can be made (``SaveFiles.linked``). On any exception before the commit the
    temporary files are removed and whatever was at ``path`` stays as it was.
    """
    target = os.path.abspath(path)
    directory = os.path.dirname(target)
    makedirs_durably(directory)
    check_names_fit(target, with_data)
    sweep_stale(directory)
    free = shutil.disk_usage(directory).free
    if free < required_bytes:
        raise CheckpointSaveError(
            f"not enough free disk space: the checkpoint needs {required_bytes:,} bytes, {free:,} are free; "
            "nothing was written", path)
    tag = token()
    tmp_main = hidden_name(target, tag, "tmp")
    tmp_data = hidden_name(data_path(target), tag, "tmp") if with_data else None
    opened: list[BinaryIO] = []
    try:
        opened.append(open(tmp_main, "xb", buffering=0))
        linked = tmp_data is not None and link_data is not None and link_into(*link_data, tmp_data)
        if tmp_data is not None and not linked:
            opened.append(open(tmp_data, "xb", buffering=0))
        yield SaveFiles(opened[0], opened[1] if len(opened) > 1 else None, linked)
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
