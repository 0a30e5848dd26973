"""Crash-safe replacement of a checkpoint and its ``.data`` companion.

A save writes temporary files in the target's directory, fsyncs them and renames them into place, so a failure,
a full disk or a kill leaves the previous checkpoint untouched. A checkpoint with external data is two files that
cannot be renamed together; a small journal (``<path>.commit``), written durably before the first rename, records
the pair, and :func:`recover` completes an interrupted commit, so our readers never pair a new ``.ckpt`` with an
old ``.data``. Replaced files are unlinked on a background thread: freeing gigabytes can take seconds on these disks.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import secrets
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from ..errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError

DATA_SUFFIX = ".data"
JOURNAL_SUFFIX = ".commit"


def data_path(path: str) -> str:
    """ORT's external data file: the checkpoint path string plus ``.data``."""
    return path + DATA_SUFFIX


@dataclass
class SaveFiles:
    """Open temporary files of a save in progress; ``data`` is None when the checkpoint has no external data."""

    main: BinaryIO
    data: BinaryIO | None


@contextlib.contextmanager
def atomic_save(path: str, *, with_data: bool, required_bytes: int) -> Iterator[SaveFiles]:
    """Yield temporary files to write; on a clean exit make them durable and move them to ``path``.

    On any exception the temporary files are removed and whatever was at ``path`` stays as it was.
    """
    directory, base = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    recover(path)
    _sweep_stale(directory)
    free = shutil.disk_usage(directory).free
    if free < required_bytes:
        raise CheckpointSaveError(
            f"not enough free disk space: the checkpoint needs {required_bytes:,} bytes, {free:,} are free; "
            "nothing was written", path)
    token = f"{os.getpid()}.{secrets.token_hex(4)}"
    tmp_main = os.path.join(directory, f".{base}.{token}.tmp")
    tmp_data = os.path.join(directory, f".{base}{DATA_SUFFIX}.{token}.tmp") if with_data else None
    opened: list[BinaryIO] = []
    try:
        opened.append(open(tmp_main, "xb", buffering=0))
        if tmp_data is not None:
            opened.append(open(tmp_data, "xb", buffering=0))
        yield SaveFiles(opened[0], opened[1] if tmp_data else None)
        for f in opened:
            os.fsync(f.fileno())
            f.close()
    except BaseException as e:
        for f in opened:
            f.close()
        for tmp in (tmp_main, tmp_data):
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        # e.g. a tensor whose copy fails midway (a meta tensor); the writer words OSErrors (EFBIG, ENOSPC) itself
        if isinstance(e, Exception) and not isinstance(e, (CheckpointError, OSError)):
            raise CheckpointSaveError(f"save failed ({type(e).__name__}: {e}); the previous checkpoint at this "
                                      "path, if any, is unchanged", path) from e
        raise
    _commit(path, directory, tmp_main, tmp_data)


def _commit(path: str, directory: str, tmp_main: str, tmp_data: str | None) -> None:
    retired: list[str] = []
    if tmp_data is None:
        retired += _retire(path)
        os.replace(tmp_main, path)
        _fsync_dir(directory)
        if os.path.lexists(data_path(path)):  # the replaced checkpoint's external data is now stale
            trash = _trash_name(data_path(path))
            os.replace(data_path(path), trash)
            retired.append(trash)
    else:
        journal = path + JOURNAL_SUFFIX
        _write_durably(journal, json.dumps({"checkpoint": os.path.basename(tmp_main),
                                            "data": os.path.basename(tmp_data)}).encode(), directory)
        retired += _retire(data_path(path))
        os.replace(tmp_data, data_path(path))
        retired += _retire(path)
        os.replace(tmp_main, path)
        _fsync_dir(directory)
        os.unlink(journal)
    for trash in retired:
        _UNLINKER.put(trash)


def recover(path: str) -> None:
    """Complete a commit that was interrupted between its renames (a no-op when there is none)."""
    journal = path + JOURNAL_SUFFIX
    if not os.path.exists(journal):
        return
    directory = os.path.dirname(os.path.abspath(path))
    try:
        with open(journal, "rb") as f:
            names = json.loads(f.read())
        tmp_main = os.path.join(directory, os.path.basename(names["checkpoint"]))
        tmp_data = os.path.join(directory, os.path.basename(names["data"]))
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise CorruptCheckpointError(f"unreadable commit journal {journal} ({e}); remove it to use the checkpoint "
                                     "as it is", path) from None
    try:
        if os.path.exists(tmp_data):
            os.replace(tmp_data, data_path(path))
        if os.path.exists(tmp_main):
            os.replace(tmp_main, path)
        _fsync_dir(directory)
        os.unlink(journal)
    except OSError as e:
        raise CorruptCheckpointError(f"a save was interrupted while replacing this checkpoint and its .data file, "
                                     f"and completing it failed ({e}); retry with write access to the directory",
                                     path) from None


def wait_for_cleanup() -> None:
    """Block until replaced files queued for deletion are gone (tests and benchmarks use this)."""
    _UNLINKER.join()


def _retire(path: str) -> list[str]:
    """Give ``path`` a second name so that replacing it does not free its blocks on the caller's thread."""
    if not os.path.lexists(path):
        return []
    trash = _trash_name(path)
    try:
        os.link(path, trash)
    except OSError:  # no hard links here: let the rename free the blocks
        return []
    return [trash]


def _trash_name(path: str) -> str:
    directory, base = os.path.split(path)
    return os.path.join(directory, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.old")


def _write_durably(path: str, data: bytes, directory: str) -> None:
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sweep_stale(directory: str) -> None:
    """Queue for deletion what saves by processes that no longer run left in ``directory``: temporary files of
    interrupted saves, and replaced or deleted checkpoints (``.<name>.<pid>.<token>.old``) killed before unlinking."""
    with os.scandir(directory) as entries:
        for entry in entries:
            m = _LEFTOVER.match(entry.name)
            if m and not _alive(int(m.group(1))):
                _UNLINKER.put(entry.path)


_LEFTOVER = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{8}\.(?:tmp|old)$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class _Unlinker:
    """One daemon thread that deletes files in the order they were queued."""

    def __init__(self) -> None:
        self._queue: queue.Queue[str] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, path: str) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ort-ckpt-unlink", daemon=True)
                self._thread.start()
        self._queue.put(path)

    def join(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            path = self._queue.get()
            with contextlib.suppress(OSError):
                os.unlink(path)
            self._queue.task_done()


_UNLINKER = _Unlinker()


def remove(path: str) -> None:
    """Delete a checkpoint together with its ``.data`` file and any commit journal; the blocks are freed later."""
    for victim in (path + JOURNAL_SUFFIX, data_path(path), path):
        if os.path.lexists(victim):
            trash = _trash_name(victim)
            os.replace(victim, trash)
            _UNLINKER.put(trash)


def link(target: str, linkpath: str) -> None:
    """Point ``linkpath`` at ``target`` (a relative symbolic link), and ``linkpath.data`` at its ``.data`` if any.

    Each link is made under a temporary name and renamed over the old one, so ``linkpath`` always resolves.
    """
    pairs = [(target, linkpath)]
    if os.path.exists(data_path(target)):
        pairs.insert(0, (data_path(target), data_path(linkpath)))
    elif os.path.lexists(data_path(linkpath)):  # left from an earlier target that had external data
        trash = _trash_name(data_path(linkpath))
        os.replace(data_path(linkpath), trash)
        _UNLINKER.put(trash)
    directory = os.path.dirname(os.path.abspath(linkpath))
    for source, name in pairs:
        tmp = _trash_name(name).removesuffix(".old") + ".tmp"
        os.symlink(os.path.relpath(os.path.abspath(source), directory), tmp)
        os.replace(tmp, name)
    _fsync_dir(directory)
