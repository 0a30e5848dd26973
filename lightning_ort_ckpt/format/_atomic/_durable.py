"""Making directory entries durable: directories created with their parents fsynced, renames fsynced where the file
system can, and temporaries discarded quietly when a save gives up."""

from __future__ import annotations

import contextlib
import errno
import os

from .._platform import portable_io


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
