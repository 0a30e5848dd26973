"""Range reads (a whole file, or one tensor's bytes): the page cache's part copied (and dropped), the rest read with
direct I/O, the same bytes every way.

Files are random bytes of an odd size (not a multiple of any block), a few chunks long, so every path meets a
partial last block. Page-cache residency is read with mincore.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np
import pytest

from lightning_ort_ckpt import CorruptCheckpointError
from lightning_ort_ckpt.format import _diskio as diskio

SIZE = 2 * diskio._READ_CHUNK + 3 * 4096 + 123  # three chunks, the last one short and ending mid-block
MIDDLES = (diskio._READ_CHUNK // 2 + 4321, 3 * diskio._READ_CHUNK // 2)  # far from where read-ahead may start


@pytest.fixture()
def data_file(tmp_path):
    payload = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path = str(tmp_path / "blob.bin")
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    return path, payload


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached(path: str, offset: int) -> bool:
    """Whether the page cache holds the page at ``offset`` (mincore: unlike a probing read, it starts no read-ahead)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = offset - offset % mmap.PAGESIZE
    vec = ctypes.c_ubyte()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        anchor = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(anchor) + page
        rc = libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(mmap.PAGESIZE), ctypes.byref(vec))
        del anchor  # the mapping can close only once nothing points into it
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return bool(vec.value & 1)


def read(path: str, size: int = SIZE) -> np.ndarray:
    fd = os.open(path, os.O_RDONLY)
    try:
        return diskio.read_range(fd, 0, size, path)
    finally:
        os.close(fd)


def test_cold_read_is_exact_and_leaves_the_page_cache_alone(data_file):
    path, payload = data_file
    evict(path)
    out = read(path)
    assert out.tobytes() == payload
    assert out.ctypes.data % 4096 == 0
    # read straight from the disk: pages away from the chunk starts (where a probe may start read-ahead) stay uncached
    assert not any(cached(path, off) for off in MIDDLES)


def test_warm_and_partly_cached_reads_are_exact_and_drop_what_they_copied(data_file):
    path, payload = data_file
    assert all(cached(path, off) for off in (0, *MIDDLES))  # written just now
    assert read(path).tobytes() == payload
    assert not any(cached(path, off) for off in (0, *MIDDLES))  # copied, then dropped: in memory once, not twice
    evict(path)
    with open(path, "rb") as f:  # cache some unaligned ranges, including across a chunk boundary
        for off, n in ((5, 10_000), (diskio._READ_CHUNK - 7777, 20_000), (SIZE - 300, 300), (3 << 20, 1 << 20)):
            f.seek(off)
            f.read(n)
    assert cached(path, diskio._READ_CHUNK) and not any(cached(path, off) for off in MIDDLES)
    assert read(path).tobytes() == payload
    assert not cached(path, diskio._READ_CHUNK)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_ranges_at_odd_offsets_are_exact(data_file, warm):
    """As a load reads tensors: ranges starting and ending mid-block, across chunks, small and large."""
    path, payload = data_file
    if not warm:
        evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, size in ((4321, diskio._READ_CHUNK + 777), (diskio._READ_CHUNK - 5, 300_001), (SIZE - 100, 100),
                            (8192, diskio._DIRECT_MIN)):
            out = diskio.read_range(fd, start, size, path)
            assert out.tobytes() == payload[start:start + size]
            assert out.flags.writeable
    finally:
        os.close(fd)


def test_falls_back_to_plain_reads_where_direct_io_is_refused(data_file, monkeypatch):
    """A file system without direct I/O refuses the open with ``O_DIRECT`` (EINVAL), as tmpfs did before Linux 6.6."""
    path, payload = data_file
    evict(path)
    real = os.open

    def refuse_direct(name, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(name, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_direct)
    assert read(path).tobytes() == payload
    assert all(cached(path, off) for off in MIDDLES)  # read through the page cache, which keeps it


def test_reads_on_two_threads_at_once_are_exact(data_file):
    """As a large load reads: two threads at once on the same descriptors, one of them opened for direct I/O. The
    direct flag lives on its own descriptor: set on the shared one, it would fail the other thread's plain reads."""
    import concurrent.futures

    path, payload = data_file
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    direct = diskio.open_direct(fd)
    try:
        assert direct is not None  # Linux with /proc, on a file system with direct I/O
        ranges = [(start, size) for start in range(0, SIZE - 600_000, 700_001) for size in (7, 300_001, 600_000)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda r: diskio.read_range(fd, r[0], r[1], path, direct), ranges))
        for (start, size), out in zip(ranges, outs):
            assert out.tobytes() == payload[start:start + size]
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_file_shorter_than_expected_is_our_error(data_file, warm):
    path, _ = data_file
    if not warm:
        evict(path)
    with pytest.raises(CorruptCheckpointError, match="shrank while being read"):
        read(path, SIZE + 50_000)


def test_small_files_are_plain_memory(tmp_path):
    path = str(tmp_path / "small.bin")
    with open(path, "wb") as f:
        f.write(b"abc" * 1000)
    out = read(path, 3000)
    assert out.tobytes() == b"abc" * 1000 and out.flags.writeable
