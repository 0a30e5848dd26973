"""How bytes move between checkpoint files and memory, fast and without flooding the page cache.

Saves stream with write-behind (:class:`WriteBehind`); loads (:func:`read_range`, one per tensor) copy what the page
cache already holds (and drop it from the cache) and read the rest with direct I/O into huge-page memory. Both exist for
the same reason: on the VMs this project runs on, fresh memory (new page-cache pages, a new buffer) costs more than
the disk, because the guest hands freed memory back to its host and every 4 KiB page touched again is a fault to
the host. Everything here is an optimization with a plain fallback: where a call is missing or refused (not Linux, a
file system without direct I/O), or the portable path is forced (``platform.portable_io``), the result is the same
bytes by ordinary reads and writes.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any, BinaryIO

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError
from ._platform import portable_io

BEHIND_BYTES = 8 << 20  # write-behind step: see WriteBehind
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4  # sync_file_range(2) flags
_libc_sync_file_range: Any = None  # looked up on first use; False where the C library has none


class WriteBehind:
    """Sends a file that is being written sequentially to the disk as it grows, and drops from the page cache what
    is already on the disk.

    Plain writes dirty as many page-cache pages as the checkpoint has bytes, and leave all of it to the final fsync,
    with nothing overlapping it. Those pages are fresh memory: on a VM that has handed its free memory back to the
    host, each 4 KiB costs a fault to get it back (this dominated multi-GB saves on the benchmark machine), and they
    push the training job's own cached files out of memory. Here every ``BEHIND_BYTES`` step is sent to the disk as
    soon as it is written, while the next step is copied; the step before it is then waited for and dropped. At most
    two steps stay cached, the same pages are reused, and the fsync that follows has almost nothing left to write.
    The file's bytes, the atomic commit and the fsync are unchanged; the one visible difference is that a checkpoint
    just saved is not in the page cache for an immediate reload. A writeback error is raised here: waiting with
    sync_file_range consumes the error report that the later fsync would otherwise have seen.
    """

    def __init__(self, fd: int, base: int, sync_file_range: Any) -> None:
        self.fd, self.sfr = fd, sync_file_range
        self.base = self.started = self.dropped = base  # file offsets: [.., started) sent, [.., dropped) dropped

    @classmethod
    def open(cls, out: BinaryIO) -> WriteBehind | None:
        """A write-behind for ``out``, or None when it is not a regular file or the system lacks the calls."""
        import stat

        global _libc_sync_file_range
        if portable_io():
            return None
        if _libc_sync_file_range is None:
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _libc_sync_file_range = fn
            except (OSError, AttributeError, TypeError):  # not Linux (Windows: CDLL(None) is a TypeError)
                _libc_sync_file_range = False
        if not _libc_sync_file_range or not hasattr(os, "posix_fadvise"):
            return None
        try:
            fd = out.fileno()
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            base = os.lseek(fd, 0, os.SEEK_CUR)
        except (AttributeError, OSError, ValueError):  # no file descriptor (io.UnsupportedOperation is both)
            return None
        return cls(fd, base, _libc_sync_file_range)

    def advance(self, written: int) -> None:
        """``written`` bytes have now been written since the start."""
        end = self.base + written
        if end - self.started < BEHIND_BYTES:
            return
        self._sync(self.started, end - self.started, _SFR_WRITE)  # start this step's writeback, do not wait
        if self.started > self.dropped:  # the step before: wait until it is on the disk, then uncache it
            self._sync(self.dropped, self.started - self.dropped, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
            if self.sfr is not None:
                try:
                    os.posix_fadvise(self.fd, self.dropped, self.started - self.dropped, os.POSIX_FADV_DONTNEED)
                except OSError:  # advice only
                    pass
            self.dropped = self.started
        self.started = end

    def _sync(self, offset: int, nbytes: int, flags: int) -> None:
        if self.sfr is None or self.sfr(self.fd, offset, nbytes, flags) == 0:
            return
        import ctypes

        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.ESPIPE, errno.EINVAL, errno.EOPNOTSUPP):  # not for this file: plain writes
            self.sfr = None
            return
        raise OSError(err, os.strerror(err))


def open_regular(path: str, what: str = "checkpoint", owner: str | None = None) -> int:
    """A read-only file descriptor for ``path``, which must be a regular file: a FIFO must not block the open (nor
    a later read), a directory or device is not a checkpoint. ``what`` and ``owner`` word the error (the file of a
    ``.data`` companion is its checkpoint).

    Where ``O_NONBLOCK`` exists (not Windows) and the portable path is not forced, the open itself cannot block;
    elsewhere the path is checked with ``stat`` before it is opened and with ``fstat`` after.
    """
    where = path if owner is None else owner
    label = "checkpoint" if owner is None else f"{what} file {path}"
    nonblock = getattr(os, "O_NONBLOCK", 0) if not portable_io() else 0
    try:
        if not nonblock:
            check_regular(os.stat(path).st_mode, label, where)
        fd = os.open(path, os.O_RDONLY | nonblock | getattr(os, "O_BINARY", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise CorruptCheckpointError("no such checkpoint file" if owner is None else f"its {label} is missing",
                                     where) from None
    except OSError as e:  # permission denied, a symlink loop, a socket (which no open takes), ...
        check_kind(path, label, where)
        raise CheckpointError(f"cannot open the {label}: {e.strerror or e}", where) from None
    try:
        check_regular(os.fstat(fd).st_mode, label, where)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_kind(path: str, label: str, where: str) -> None:
    """After an open of ``path`` failed: our error saying what it is when it is no regular file (a socket cannot be
    opened at all, so the open's own error would not say); nothing where it cannot be looked at either."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return
    check_regular(mode, label, where)


def check_regular(mode: int, label: str, where: str) -> None:
    """Raise our error unless ``mode`` (of ``os.stat``) is a regular file's: a directory, FIFO or device is not a
    checkpoint (``label`` names the file in the message, ``where`` is the checkpoint it belongs to)."""
    import stat

    if stat.S_ISDIR(mode):
        raise CorruptCheckpointError(f"{label} is a directory, not a file", where)
    if not stat.S_ISREG(mode):
        raise CorruptCheckpointError(f"{label} is not a regular file (a FIFO, socket or device)", where)


_HUGE_PAGE = 2 << 20
_DIRECT_ALIGN = 4096  # offset, length and memory alignment of direct reads: every disk's logical block divides it
_DIRECT_MIN = 256 << 10  # smaller ranges are read plainly: direct I/O would save little
_READ_CHUNK = 64 << 20  # reads go in steps of this size, each from the cache or the disk


def fresh_memory(size: int) -> np.ndarray:
    """``size`` bytes of fresh, writable memory for a read; page-aligned from ``_DIRECT_MIN`` on, as direct I/O
    needs.

    Those are private anonymous mappings, advised for transparent huge pages from 2 MiB on: 512 times fewer
    first-touch faults than 4 KiB pages. Where mappings or the advice are unknown (not Linux), or the portable path is
    forced, it is ordinary memory. The mapping is unmapped when the last array or tensor viewing it goes away.
    """
    if size < _DIRECT_MIN or not hasattr(mmap, "MADV_HUGEPAGE") or portable_io():
        return np.empty(size, dtype=np.uint8)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= _HUGE_PAGE:
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # advice only (THP compiled out)
            pass
    return np.frombuffer(mm, dtype=np.uint8)


def open_direct(fd: int) -> int | None:
    """A second descriptor of the open file ``fd`` with ``O_DIRECT`` set (the caller closes it), or None where there
    is none to be had (not Linux, the portable path forced, a file system without direct I/O).

    The flag belongs to the open file, shared by every descriptor duplicated from it: set on ``fd`` for one read, it
    would fail another thread's plain read of ``fd`` meanwhile. This one is opened through ``/proc/self/fd``, which
    names the open file itself (not its path, which may lead elsewhere by now), and is checked to be the same file.
    """
    if portable_io() or not hasattr(os, "O_DIRECT") or not hasattr(os, "RWF_NOWAIT"):
        return None
    try:
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_NONBLOCK)
    except OSError:  # no /proc, or direct I/O refused on this file system
        return None
    try:
        same = os.path.samestat(os.fstat(fd), os.fstat(direct))
    except OSError:
        same = False
    if not same:
        os.close(direct)
        return None
    return direct


def read_range(fd: int, start: int, size: int, path: str, direct_fd: int | None = None) -> np.ndarray:
    """Bytes ``start`` to ``start + size`` of the open file ``fd``, in fresh memory of their own.

    A whole-file load calls this once per tensor, so that each tensor owns its memory (a tensor kept alive keeps
    only its own bytes alive) and no whole-file buffer is ever allocated. Step by step, what the page cache already
    holds is copied from it (``RWF_NOWAIT`` reads stop at the first uncached page) and then dropped from the cache,
    and the rest is read through ``direct_fd`` (the same file opened with ``O_DIRECT``: :func:`open_direct`), from
    the disk straight into the memory (which then spans the whole blocks around the range; the array returned views
    the range). A buffered read of an uncached file would first fill the page cache: as much fresh memory again as
    the file, which on VMs costs more than the disk (docs/performance.md has the measurements), and it would push the
    training job's own files out of the cache. Dropping what was copied keeps the checkpoint in memory once, not
    twice, and the pages it frees are the ones the next tensors then reuse, instead of fresh memory; a later load of
    the same file reads it directly, which is the fast path anyway. Pages that some process has mapped, or that are
    dirty, stay cached. Without ``direct_fd`` a large range opens one of its own for the call (a load reading many
    tensors passes its own, opened once). Small ranges, and systems or file systems without these calls, get plain
    reads, and nothing is dropped. Safe to call from several threads at once on the same descriptors.
    """
    own = None
    if direct_fd is None and size >= _DIRECT_MIN:
        direct_fd = own = open_direct(fd)
    try:
        return _read_range(fd, start, size, path, direct_fd)
    finally:
        if own is not None:
            os.close(own)


def _read_range(fd: int, start: int, size: int, path: str, direct_fd: int | None) -> np.ndarray:
    portable = portable_io()
    direct = direct_fd is not None and size >= _DIRECT_MIN and not portable and hasattr(os, "preadv")
    head = start % _DIRECT_ALIGN if direct else 0
    out = fresh_memory(_whole_blocks(head + size) if direct else size)  # direct reads fill whole blocks
    base = start - head  # the file offset of out[0]
    view = out.data  # (the array is contiguous: its buffer as a memoryview)
    if not direct and size >= _DIRECT_MIN and not portable and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, start, size, os.POSIX_FADV_SEQUENTIAL)
    pos, stop = start, start + size
    while pos < stop:
        end = min(pos + _READ_CHUNK, stop)
        if direct:
            try:
                pos = _read_cached(fd, view, base, pos, end, path)
                if pos < end:
                    pos = _read_direct(direct_fd, view, base, pos, end, path)  # type: ignore[arg-type]
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):  # anything but "not on this file": a real error
                    raise
                direct = False  # plain reads from here on
        while pos < end and not direct:
            n = _pread_into(fd, view[pos - base:end - base], pos, portable)
            if n == 0:
                raise _shrank(pos, path)
            pos += n
    return out[head:head + size]


def _pread_into(fd: int, buf: memoryview, pos: int, portable: bool) -> int:
    """Read into ``buf`` from offset ``pos``: ``preadv`` where there is one, else seek and read (Windows)."""
    if hasattr(os, "preadv") and not portable:
        return os.preadv(fd, [buf], pos)
    import io

    with io.FileIO(fd, "rb", closefd=False) as f:
        f.seek(pos)
        return f.readinto(buf) or 0


def _read_cached(fd: int, view: memoryview, base: int, pos: int, end: int, path: str) -> int:
    """Copy from the page cache from file offset ``pos`` on (into ``view``, which starts at offset ``base``), up to
    ``end`` or the first page it does not hold, and drop what was copied from the cache; the new pos."""
    start = pos
    while pos < end:
        # One page first: a read that misses the cache still starts the kernel's readahead of its window (8 MiB
        # here), which would then be copied through the cache instead of read directly (a cold 1.2 GB load: 1.1 s
        # against 0.35 s for the direct reads alone).
        stop = min(pos + _DIRECT_ALIGN, end) if pos == start else end
        try:
            n = os.preadv(fd, [view[pos - base:stop - base]], pos, os.RWF_NOWAIT)
        except BlockingIOError:  # the next page is not cached
            break
        if n == 0:
            raise _shrank(pos, path)
        pos += n
    if pos > start:
        os.posix_fadvise(fd, start, pos - start, os.POSIX_FADV_DONTNEED)
    return pos


def _read_direct(direct_fd: int, view: memoryview, base: int, pos: int, end: int, path: str) -> int:
    """Read from the disk, bypassing the page cache (``direct_fd`` has ``O_DIRECT``), from the block holding ``pos``
    to ``end`` (into ``view``, which starts at the block-aligned offset ``base``); the new pos (less than ``end``
    after a short read: the caller goes on from there)."""
    start = pos - pos % _DIRECT_ALIGN
    stop = _whole_blocks(end)  # the buffer is rounded up to whole blocks too
    n = os.preadv(direct_fd, [view[start - base:stop - base]], start)
    if start + n <= pos:
        raise _shrank(start + n, path)
    return min(start + n, end)


def _whole_blocks(nbytes: int) -> int:
    """``nbytes`` rounded up to whole direct-I/O blocks."""
    return -(-nbytes // _DIRECT_ALIGN) * _DIRECT_ALIGN


def _shrank(pos: int, path: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"file ended early at byte {pos:,} (it shrank while being read)", path)
