"""The local disk as a checkpoint store: the journaled atomic commit of ``_atomic`` (durable directories, writer
locks, crash recovery), hard links for frozen sharing and relative symbolic links for ``save_last="link"``. It takes
every path no other backend claims (a path, or a ``file://`` URL)."""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from ..errors import CheckpointError
from . import _atomic
from ._atomic import SaveFiles
from ._diskio import check_regular, open_regular
from ._naming import data_path
from ._urls import is_remote


_MEMORY_FILE_SYSTEMS = {"tmpfs", "ramfs"}


def file_system_type(folder: str) -> str | None:
    """The type of the file system holding ``folder`` (Linux: the mount table's, for the longest mount point above
    its real path); None where there is no mount table to read."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
            table = [line.split() for line in mounts]
    except OSError:
        return None
    real, best, kind = os.path.realpath(folder), "", None
    for fields in table:
        if len(fields) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # (a space: \040)
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


class LocalStore:
    """Checkpoint files on the local file system (see ``_store.Store`` for each method's contract)."""

    rewritable = True
    links = hasattr(os, "link")
    local = True

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        """``storage_options`` are fsspec's, for URLs: the local disk takes none (they are ignored)."""
        self._in_memory: dict[str, bool] = {}  # by folder: the mount table is read once per folder

    def in_memory(self, path: str) -> bool:
        folder = os.path.dirname(os.path.abspath(path))
        found = self._in_memory.get(folder)
        if found is None:
            found = self._in_memory[folder] = file_system_type(folder) in _MEMORY_FILE_SYSTEMS
        return found

    @classmethod
    def handles(cls, path: str | os.PathLike[str] | None) -> bool:
        return not is_remote(path)

    @classmethod
    def wait_for_cleanup(cls) -> None:
        _atomic.wait_for_cleanup()

    def writing(self, path: str, *, with_data: bool, required_bytes: int,
                link_data: Callable[[str], bool] | None = None) -> AbstractContextManager[SaveFiles]:
        return _atomic.atomic_save(path, with_data=with_data, required_bytes=required_bytes, link_data=link_data)

    @contextlib.contextmanager
    def fetched(self, path: str) -> Iterator[str]:
        yield path

    def read_head(self, path: str, size: int) -> bytes:
        try:
            mode = os.stat(path).st_mode
        except (OSError, ValueError):  # missing, a symlink loop, no access: nothing to read
            return b""
        if not stat.S_ISDIR(mode):
            check_regular(mode, "checkpoint", path)  # a FIFO, socket or device: our error, never a wait
        try:
            fd = open_regular(path)  # non-blocking: a FIFO put there since cannot block us either
        except CheckpointError:  # missing, a directory, no access, a symlink loop: nothing to read
            return b""
        try:
            return os.read(fd, size)
        except OSError:
            return b""
        finally:
            os.close(fd)

    def check_file(self, path: str) -> None:
        if os.path.lexists(path) and not os.path.isdir(path):
            os.close(open_regular(path))  # non-blocking, and our error for anything but a readable regular file

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def is_directory(self, path: str) -> bool:
        return os.path.isdir(path)

    def join(self, directory: str, name: str) -> str:
        return os.path.join(directory, name)

    def absolute(self, path: str) -> str:
        return os.path.abspath(path)

    def temp_name(self, path: str) -> str:
        return _atomic.temp_name(path)

    def modified(self, path: str) -> float:
        try:
            return os.stat(path).st_mtime
        except (OSError, ValueError):
            return float("-inf")

    def list_files(self, directory: str, recursive: bool) -> list[str]:
        return self._listed(directory, recursive, folders=False)

    def list_folders(self, directory: str, recursive: bool) -> list[str]:
        return self._listed(directory, recursive, folders=True)

    @staticmethod
    def _listed(directory: str, recursive: bool, folders: bool) -> list[str]:
        found: list[str] = []
        for folder, subfolders, files in os.walk(directory):
            visible = sorted(d for d in subfolders if not d.startswith("."))
            found += (os.path.join(folder, f) for f in (visible if folders else files) if not f.startswith("."))
            subfolders[:] = visible if recursive else []
        return sorted(found)

    def remove(self, path: str) -> None:
        _atomic.remove(path)

    def link_or_copy(self, target: str, linkpath: str) -> None:
        _atomic.link(target, linkpath)

    def link_target(self, path: str) -> str | None:
        if not os.path.islink(path):
            return None
        return os.path.join(os.path.dirname(path), os.readlink(path))

    def size(self, path: str) -> int:
        files = [path, data_path(path)] if not os.path.isdir(path) else self._listed(path, True, False)
        return sum(os.path.getsize(f) for f in files if os.path.isfile(f))

    def contains(self, directory: str, path: str) -> bool:
        root = os.path.realpath(directory)
        folder = os.path.realpath(os.path.dirname(path) or os.curdir)
        return folder == root or folder.startswith(root.rstrip(os.sep) + os.sep)
