"""Linking, cloning, copying and checking a shared ``.data``: new names and independent copies of one file."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from dataclasses import dataclass

from .. import _checksums


Identity = tuple[int, int, int, int]
"""A ``.data`` file as ``(st_dev, st_ino, st_size, st_mtime_ns)``: the inode that a link must reach. The size and
modification time (which links, renames and mode changes leave alone) tell a reused inode number from ours."""


def identity(st: os.stat_result) -> Identity:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


_FICLONE = 0x40049409  # Linux's _IOW(0x94, 9, int): make the open file a copy-on-write clone of another
CAN_CLONE = sys.platform.startswith("linux")
"""Whether this platform has the clone ioctl (each file system still says whether it supports it)."""


def link_into(source: str, expected: Identity, tmp: str) -> bool:
    """Make ``tmp`` a copy-on-write clone of ``source`` where the file system offers clones, else a hard link to it,
    if ``source`` is still the inode ``expected``; False (nothing left behind) where it is not or neither can be made
    (``EXDEV``: another file system; ``EPERM``: no hard links there)."""
    with contextlib.suppress(OSError):
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            if identity(os.fstat(fd)) == expected and _clone(fd, tmp):
                return True
        finally:
            os.close(fd)
    try:
        os.link(source, tmp, follow_symlinks=False)
    except (OSError, NotImplementedError):
        return False
    with contextlib.suppress(OSError):
        if identity(os.stat(tmp, follow_symlinks=False)) == expected:
            return True
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return False


def _clone(source_fd: int, tmp: str) -> bool:
    """A durable, read-only clone of the open file at the new name ``tmp``; False (nothing left) where the file
    system has none (ext4, tmpfs: ``EOPNOTSUPP``; across file systems: ``EXDEV``)."""
    if not CAN_CLONE:
        return False
    import fcntl

    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    try:
        fcntl.ioctl(fd, _FICLONE, source_fd)
        os.fsync(fd)
    except OSError:
        os.close(fd)
        os.unlink(tmp)
        return False
    os.close(fd)
    return True


def verify_data(path: str, offsets: dict[str, int], layout: dict[str, tuple[int, tuple[int, ...], int]],
                digests: dict[str, int]) -> tuple[Identity | None, list[str]]:
    """Read the tensors ``offsets`` names back from the ``.data`` file ``path`` and hash them as the writer did:
    ``(the file's identity, the names whose bytes differ from digests)``; ``(None, [])`` when it cannot be opened.
    A file shorter than a tensor's end fails that tensor. Reads through one reused 16 MiB buffer."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None, []
    bad = []
    try:
        found = identity(os.fstat(fd))
        buf = bytearray(16 << 20)
        view = memoryview(buf)
        for name, offset in sorted(offsets.items(), key=lambda item: item[1]):
            key = _checksums.param_key(name)
            if key not in digests or name not in layout:
                continue
            dtype, dims, nbytes = layout[name]
            if digest_at(fd, Slot(offset, nbytes, dtype, dims, digests[key]), view) != digests[key]:
                bad.append(name)
    except OSError:
        return None, []
    finally:
        os.close(fd)
    return found, bad


def write_copy(source: str, expected: Identity, tmp: str, offsets: dict[str, int],
               layout: dict[str, tuple[int, tuple[int, ...], int]], digests: dict[str, int]) -> tuple[bool, list[str]]:
    """Write an independent copy of the ``.data`` file ``source`` (if it is still the inode ``expected``) to the new
    name ``tmp``: its bytes read and written again (never cloned, so that no block is shared), made durable and
    read-only, then read back and hashed against ``digests`` as :func:`verify_data` does. ``(True, [])`` when the
    copy holds the right bytes; else nothing is left at ``tmp`` and ``(False, the names whose bytes differ)``: where
    some do, it is the source that holds them (the copy holds what was read from it)."""
    try:
        src = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False, []
    try:
        if identity(os.fstat(src)) != expected:
            return False, []
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        try:
            _copy_durably(src, dst)
        finally:
            os.close(dst)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False, []
    finally:
        os.close(src)
    found, bad = verify_data(tmp, offsets, layout, digests)
    if found is None or bad:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False, bad
    return True, []


_SYNC_EVERY = 32 << 20


def _copy_durably(src: int, dst: int) -> None:
    """Copy the open file ``src`` to the empty ``dst`` and make it durable: in the kernel where it can
    (``sendfile``, which writes new blocks, unlike ``copy_file_range`` that may clone them), flushed every
    :data:`_SYNC_EVERY` bytes so that little is left dirty for a concurrent save's own fsync to wait for."""
    flush = getattr(os, "fdatasync", os.fsync)
    pos, view = 0, None
    while True:
        if view is None and sys.platform.startswith("linux"):
            try:
                n = os.sendfile(dst, src, pos, _SYNC_EVERY)
            except OSError:  # not between these files here: through a buffer, from where it got to
                view = memoryview(bytearray(16 << 20))
                continue
        else:
            view = view if view is not None else memoryview(bytearray(16 << 20))
            n = _read_at(src, view, pos)
            done = 0
            while done < n:
                done += os.write(dst, view[done:n])
        if n <= 0:
            break
        pos += n
        if pos % _SYNC_EVERY < n:
            flush(dst)
    os.fsync(dst)


def _read_at(fd: int, view: memoryview, pos: int) -> int:
    """Read into ``view`` from offset ``pos``: the bytes read (0 at the end)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], pos)
    return _pread_into(fd, view, pos)


def _pread_into(fd: int, view: memoryview, pos: int) -> int:
    data = os.pread(fd, len(view), pos)
    view[:len(data)] = data
    return len(data)


@dataclass(frozen=True)
class Slot:
    """Where one tensor's bytes lie in a ``.data`` file, and what they hashed to when they were written (the
    checkpoint's checksum record)."""

    offset: int
    nbytes: int
    dtype: int
    dims: tuple[int, ...]
    digest: int


def digest_at(fd: int, slot: Slot, buf: memoryview) -> int | None:
    """The checksum of the bytes ``slot`` names in the open file ``fd``, read through ``buf``; None where the file
    ends before them."""
    h = _checksums.hasher(slot.dtype, slot.dims)
    pos, end = slot.offset, slot.offset + slot.nbytes
    while pos < end:
        n = _read_at(fd, buf[:min(len(buf), end - pos)], pos)
        if n <= 0:
            return None
        h.update(buf[:n])
        pos += n
    return int(h.intdigest())


def read_slot(fd: int, slot: Slot) -> bytearray | None:
    """The bytes ``slot`` names in ``fd`` when they match its digest, else None."""
    out = bytearray(slot.nbytes)
    view, pos = memoryview(out), 0
    while pos < slot.nbytes:
        n = _read_at(fd, view[pos:], slot.offset + pos)
        if n <= 0:
            return None
        pos += n
    h = _checksums.hasher(slot.dtype, slot.dims)
    h.update(out)
    return out if h.intdigest() == slot.digest else None


def inode_of(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None
