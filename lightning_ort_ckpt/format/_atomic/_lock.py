"""The writers' lock of a directory: two processes saving, removing or linking in one directory never undo each
other's renames. Held only for the renames of a commit, a removal or a link (milliseconds), whose holder makes them
durable with an fsync of the directory (:meth:`WriterLock.fsync`, :func:`fsync_dir`)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time

from ...errors import CheckpointSaveError
from .._platform import portable_io
from ._names import BOOT, HOST, dead

try:
    import fcntl
except ImportError:  # not a POSIX system: the lock file is the only lock
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".ort_ckpt.lock"  # the writers' lock file, where the directory itself cannot be locked
LOCK_STALE_S = 120.0  # a lock file this old is a dead writer's: a commit holds it for milliseconds
LOCK_WAIT_S = 300.0  # how long a writer waits for another writer's commit before it gives up


class WriterLock:
    """Exclusive right to commit in a directory: ``flock`` on the directory itself (no file appears), or, where that
    is unavailable (no ``fcntl``, a file system without locks, or portable I/O), an exclusively created lock file
    naming its holder."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._dir_fd: int | None = None
        self._lock_file: str | None = None

    def __enter__(self) -> WriterLock:
        if fcntl is not None and not portable_io():
            with contextlib.suppress(OSError):
                fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError:
                    os.close(fd)
                    raise
                self._dir_fd = fd
                return self
        self._acquire_lock_file()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)  # closing releases the flock
            self._dir_fd = None
        if self._lock_file is not None:
            _drop(self._lock_file)
            self._lock_file = None

    def fsync(self) -> None:
        """Make the directory's entries durable."""
        if self._dir_fd is not None:
            fsync_fd(self._dir_fd)
        else:
            fsync_dir(self.directory)

    def _acquire_lock_file(self) -> None:
        name = os.path.join(self.directory, LOCK_NAME)
        owner = f"{HOST}-{BOOT}.{os.getpid()}".encode()
        deadline, pause = time.monotonic() + LOCK_WAIT_S, 0.001
        while True:
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if _lock_file_is_stale(name):
                    _drop(name)
                    continue
                if time.monotonic() > deadline:
                    raise CheckpointSaveError(f"another process has held the lock file {name} for over "
                                              f"{LOCK_WAIT_S:.0f} s; if no save is running, delete it") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
                continue
            except OSError as e:  # a read-only or full file system
                raise CheckpointSaveError(f"cannot create the writers' lock file ({e.strerror or e}); nothing was "
                                          "changed", name) from None
            try:
                os.write(fd, owner)
            except OSError as e:
                _drop(name)
                raise CheckpointSaveError(f"cannot write the writers' lock file ({e.strerror or e}); nothing was "
                                          "changed", name) from None
            finally:
                os.close(fd)
            self._lock_file = name
            return


def _lock_file_is_stale(name: str) -> bool:
    try:
        with open(name, "rb") as f:
            owner = f.read(64).decode("ascii", "replace")
        age = time.time() - os.stat(name).st_mtime
    except OSError:
        return False  # gone already: try again
    m = re.fullmatch(r"(?P<host>[0-9a-f]{8})-(?P<boot>[0-9a-f]{8})\.(?P<pid>\d+)", owner)
    return age > LOCK_STALE_S or (m is not None and dead(m) is True)


def _drop(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name)


def fsync_dir(directory: str) -> None:
    """Make renames in ``directory`` durable (a no-op where a directory cannot be opened, as on Windows)."""
    flags = os.O_RDONLY | (0 if portable_io() else getattr(os, "O_DIRECTORY", 0))
    try:
        fd = os.open(directory, flags)
    except OSError:
        return
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def fsync_fd(fd: int) -> None:
    """``os.fsync`` of a directory's descriptor, where the file system can."""
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a directory; the rename is as durable as they allow
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EACCES):
            raise
