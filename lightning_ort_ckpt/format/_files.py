"""The open files of a checkpoint: the checkpoint and its ``.data`` opened as one consistent pair (``_atomic``:
never a half-committed mix, and non-blocking, so a FIFO cannot hang the open), the FlatBuffer mapped copy-on-write
(never more than it: a file may have a huge tail), and the ``.data`` file checked (a regular file, long enough, in
the checkpoint's directory) and mapped once a view of its tensors is asked for."""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from . import _atomic
from ._diskio import check_kind, check_regular, open_direct, open_regular
from ._flatbuffers import MAX_FLATBUFFER_SIZE
from ._index import CheckpointIndex, TensorInfo
from ._platform import portable_io


class CheckpointFiles:
    """The descriptors and mappings of one open checkpoint (``path``) and its ``.data``."""

    def __init__(self, path: str) -> None:
        """Open the pair and map the FlatBuffer; our error naming ``path`` for anything that is not a checkpoint
        file (missing, a directory, a FIFO, socket or device, fewer than 8 bytes)."""
        self.path = path
        self.fd = -1
        self._data_mm: Any = None
        self._mapping = threading.Lock()
        self._data: Any = None  # the .data file opened with the checkpoint, as one consistent pair
        self.mm: Any = None
        self.data_size: int | None = None  # the .data file's size when opened (None: no .data)
        self._direct: dict[tuple[int, int], int | None] = {}  # (device, inode) -> its O_DIRECT descriptor
        try:
            fd, data_fd = _atomic.open_pair(path)  # changes nothing on disk, even mid-commit
            self._data = None if data_fd is None else os.fdopen(data_fd, "rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError):
            raise CorruptCheckpointError("no such checkpoint file", path) from None
        except OSError as e:  # permission denied, a symlink loop, a socket, ...
            check_kind(path, "checkpoint", path)
            raise CheckpointError(f"cannot open the checkpoint: {e.strerror or e}", path) from None
        self.fd = fd  # kept open for full loads, which read the tensors from it
        try:
            st = os.fstat(fd)
            check_regular(st.st_mode, "checkpoint", path)
            if st.st_size < 8:
                raise CorruptCheckpointError(f"not an ORT checkpoint: the file has only {st.st_size} bytes", path)
            self.mm = _map(fd, min(st.st_size, MAX_FLATBUFFER_SIZE), path)
        except BaseException:
            self.close()
            raise

    @property
    def data_path(self) -> str:
        return _atomic.data_path(self.path)

    def index(self, short_ok: bool = False) -> CheckpointIndex:
        """The checkpoint's index, parsed from the mapping, with its ``.data`` file checked against it (or let go
        of, where the checkpoint has none). ``short_ok``: a ``.data`` shorter than its tensors need is the caller's
        to handle (the reader heals those tensors from another copy: ``_shared_data``); they are never mapped."""
        with _parsing(self.mm):
            index = CheckpointIndex(self.mm, self.path)
        if index.has_external_data:
            self._check_external_data(index, short_ok)
        elif self._data is not None:
            self._data.close()
            self._data = None
        return index

    def mapped(self, info: TensorInfo, index: CheckpointIndex) -> Any:
        """The mapping that holds ``info``'s bytes: the checkpoint's, or the ``.data`` file's (mapped on first
        use, up to the last byte a tensor of ``index`` needs: a tail beyond it is never read)."""
        if info.storage == "inline":
            return self.mm
        with self._mapping:
            if self._data_mm is None:
                needed = max(i.offset + i.nbytes for i in index.external
                             if self.data_size is None or i.offset + i.nbytes <= self.data_size)
                with self._data if self._data is not None else self._open_data() as f:
                    if os.fstat(f.fileno()).st_size < needed:
                        raise self._fail(f"its external data file {self.data_path} shrank while it was open")
                    self._data_mm = _map(f.fileno(), needed, self.path)
                self._data = None
        return self._data_mm

    def source(self, info: TensorInfo) -> tuple[int, str]:
        """The descriptor to read ``info``'s bytes from, and the path of that file (for errors)."""
        return (self.fd, self.path) if info.storage == "inline" else (self._data_fd(), self.data_path)

    def direct(self, fd: int) -> int | None:
        """A descriptor of the file open as ``fd`` (a :meth:`source`) for direct reads (``diskio.open_direct``),
        opened on first use and kept until :meth:`close`; None where direct I/O cannot be had. Kept by file, not by
        descriptor: the ``.data`` file's descriptor is opened again once mapped."""
        st = os.fstat(fd)
        with self._mapping:  # loads read on two threads
            key = (st.st_dev, st.st_ino)
            if key not in self._direct:
                self._direct[key] = open_direct(fd)
            return self._direct[key]

    def close(self) -> None:
        for direct in self._direct.values():
            if direct is not None:
                os.close(direct)
        self._direct.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._data is not None:
            self._data.close()
            self._data = None
        for mm in (self.mm, self._data_mm):
            if isinstance(mm, mmap.mmap):
                try:
                    mm.close()
                except BufferError:  # tensors handed out still use the mapping; it goes away with them
                    pass

    def _fail(self, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(message, self.path)

    def _check_external_data(self, index: CheckpointIndex, short_ok: bool) -> None:
        try:
            st = os.fstat(self._data.fileno()) if self._data is not None else os.stat(self.data_path)
        except FileNotFoundError:
            raise self._fail(f"its external data file {self.data_path} is missing") from None
        except OSError as e:  # a symlink loop, a path through a file
            raise self._fail(f"its external data file {self.data_path} cannot be opened ({e.strerror or e})") from None
        if not stat.S_ISREG(st.st_mode):
            raise self._fail(f"its external data file {self.data_path} is not a regular file")
        self._check_confined(None if self._data is None else self._data.fileno())
        self.data_size = st.st_size
        if not short_ok:
            index.check_data_size(st.st_size, self.data_path)

    def _check_confined(self, fd: int | None) -> None:
        """Refuse a ``.data`` that is, or resolves to, a file outside the checkpoint's directory (a symbolic link
        elsewhere, or one to a directory above): the checkpoint names its companion by its own path, so a planted
        link would make a reader return, and ``verify`` pass, the bytes of any file the user can read. ONNX refuses
        external data outside a model's folder for the same reason. The directory the checkpoint is named in and
        the one it resolves to both count (``save_last="link"`` links a pair into another directory). ``fd`` is the
        open ``.data``, whose own path is checked where the system says it (no race with a link changed meanwhile).
        """
        real = (_fd_path(fd) if fd is not None else None) or os.path.realpath(self.data_path)
        homes = {os.path.realpath(os.path.dirname(os.path.abspath(self.path))),
                 os.path.dirname(_fd_path(self.fd) or os.path.realpath(self.path))}
        if not any(os.path.commonpath([real, home]) == home for home in homes):
            raise self._fail(f"its external data file {self.data_path} resolves to {real}, outside the checkpoint's "
                             "directory: it is not read (copy the file next to the checkpoint if you trust it)")

    def _open_data(self) -> Any:
        """The ``.data`` file, opened again by its path (and checked again: the path may now lead elsewhere)."""
        f = os.fdopen(open_regular(self.data_path, "external data", self.path), "rb", buffering=0)
        try:
            self._check_confined(f.fileno())
        except BaseException:
            f.close()
            raise
        return f

    def _data_fd(self) -> int:
        """The ``.data`` file's descriptor: the one opened with the checkpoint, or, once mapped, opened again."""
        with self._mapping:  # verification asks from two threads
            if self._data is None:
                self._data = self._open_data()
            return self._data.fileno()


@contextlib.contextmanager
def _parsing(mm: mmap.mmap) -> Iterator[None]:
    """Read-ahead off on ``mm`` while the metadata is parsed, and the pages the parse mapped let go after it. The
    metadata lies in small pieces between the tensors' bytes: on a cold file each page fault would otherwise read
    some 128 KiB of tensor bytes around it, and on a cached one each fault maps cached pages around it into the
    process (over a third of a 300 MB file here), which would count on top of a full load's tensors. Nothing has
    been written to the (copy-on-write) mapping yet, so dropping its pages loses nothing: they map again from the
    file when read."""
    if not hasattr(mmap, "MADV_RANDOM") or portable_io():
        yield
        return
    mm.madvise(mmap.MADV_RANDOM)
    try:
        yield
    finally:
        mm.madvise(mmap.MADV_DONTNEED)
        mm.madvise(mmap.MADV_NORMAL)


def _map(fd: int, length: int, path: str) -> mmap.mmap:
    """The first ``length`` bytes of ``fd``, mapped copy-on-write (never more: a file may have a huge tail)."""
    try:
        return mmap.mmap(fd, length, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise CheckpointError(f"cannot map the file into memory: {e.strerror or e}", path) from None




def _fd_path(fd: int) -> str | None:
    """The path the open file ``fd`` has now (Linux's ``/proc``), or None where the system does not say."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return path.removesuffix(" (deleted)") if os.path.isabs(path) else None


