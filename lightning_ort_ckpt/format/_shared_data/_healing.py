"""Reads that heal: a frozen tensor whose checksum fails is read from another copy of the same bytes."""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import threading
import warnings
from dataclasses import dataclass

import numpy as np

from ...errors import CheckpointError, CheckpointWarning
from .._flatbuffers import MAX_FLATBUFFER_SIZE
from .._index import CheckpointIndex, TensorInfo
from ._links import Slot, inode_of, read_slot
from ._names import is_reserve, reserves


@dataclass
class _Peer:
    data: str
    fd: int
    slots: dict[str, Slot] | None  # what its checkpoint records; None: a reserve (no checkpoint names it)


class OtherCopies:
    """The independent copies of checkpoint ``path``'s frozen tensors other than its own ``.data``, found by what is
    recorded in its directory, not by guessing: every other checkpoint (same suffix) whose ``.data`` is another inode
    and whose own index and checksum record hold the tensor with the very checksum ``path`` records for it, then the
    reserve names ``_sharing`` keeps of a copy no checkpoint names (read at the tensor's own offset: a reserve is a
    byte copy). A peer's bytes are taken only when they hash to the recorded checksum. Peers are opened on first
    need (once, under a lock: a reader verifies on two threads) and read with ``pread`` (nothing mapped)."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self._peers: list[_Peer] | None = None
        self._opening = threading.Lock()

    def read(self, name: str, slot: Slot) -> tuple[bytearray, str] | None:
        """The bytes of tensor ``name`` (as ``slot`` says it lies in ``path``'s ``.data``) from the first other copy
        that holds them intact, and that copy's path; None where none does."""
        with self._opening:
            peers = self._open()
        for peer in peers:
            where = slot if peer.slots is None else peer.slots.get(name)
            if where is None or where.digest != slot.digest or where.nbytes != slot.nbytes:
                continue
            found = read_slot(peer.fd, where)
            if found is not None:
                return found, peer.data
        return None

    def close(self) -> None:
        with self._opening:
            for peer in self._peers or ():
                with contextlib.suppress(OSError):
                    os.close(peer.fd)
            self._peers = []

    def _open(self) -> list[_Peer]:
        if self._peers is not None:
            return self._peers
        peers: list[_Peer] = []
        directory = os.path.dirname(self.path)
        suffix = os.path.splitext(self.path)[1] or ".ckpt"
        seen = {inode_of(self.path + ".data")}
        names = []
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            names = sorted(e.path for e in entries if not e.name.startswith(".") and e.name.endswith(suffix))
        for checkpoint in [*names, *reserves(directory)]:
            reserve = is_reserve(checkpoint)
            data = checkpoint if reserve else checkpoint + ".data"
            inode = inode_of(data)
            if inode is None or inode in seen or os.path.islink(checkpoint):
                continue
            slots = None if reserve else recorded_slots(checkpoint)
            if slots == {}:
                continue
            with contextlib.suppress(OSError):
                fd = os.open(data, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                seen.add(inode)
                peers.append(_Peer(data, fd, slots))
        self._peers = peers
        return peers


class Healing:
    """The frozen tensors of one open checkpoint (``path``) whose bytes were damaged in its ``.data`` and were read
    from another copy (:class:`OtherCopies`), kept for the reader's life; one warning per reader names the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.bytes: dict[int, np.ndarray] = {}  # by id of the tensor's info
        self.healed: list[tuple[str, str]] = []  # (tensor, the copy it was read from)
        self._others = OtherCopies(path)
        self._lock = threading.Lock()  # a reader verifies on two threads

    def has(self, info: TensorInfo) -> bool:
        return id(info) in self.bytes

    def heal(self, info: TensorInfo, digest: int | None) -> bool:
        """Read frozen tensor ``info`` (recorded checksum ``digest``) from another copy whose bytes match it; False
        where it is not a frozen tensor of the ``.data`` or no copy holds it intact."""
        if info.kind != "frozen" or info.storage != "external" or digest is None:
            return False
        found = self._others.read(info.name, Slot(info.offset, info.nbytes, int(info.dtype), info.shape, digest))
        if found is None:
            return False
        with self._lock:
            self.bytes[id(info)] = np.frombuffer(found[0], dtype=np.uint8)
            self.healed.append((info.name, found[1]))
            first = len(self.healed) == 1
        if first:
            warnings.warn(f"{self.path}.data: frozen tensor {info.name!r} is damaged in this shared .data; it was "
                          f"read from the other copy {found[1]} instead, whose bytes match the checksum recorded at "
                          f"save time (other damaged tensors of it too). `ort-ckpt verify --repair {self.path}` makes "
                          "the file whole: ONNX Runtime's own reader has no such fallback", CheckpointWarning,
                          stacklevel=4)
        return True

    def into(self, info: TensorInfo, out: np.ndarray | None) -> np.ndarray:
        """The bytes of ``info`` read from another copy, in memory of their own, or copied into ``out``."""
        healed = self.bytes[id(info)]
        if out is None:
            return healed.copy()
        np.copyto(out, healed.reshape(out.shape))
        return out

    def close(self) -> None:
        self._others.close()


def recorded_slots(checkpoint: str) -> dict[str, Slot]:
    """The frozen tensors checkpoint ``checkpoint`` keeps in its ``.data``, where and with which checksum, as its
    index and checksum record say ({} where it records none: not ours, no ``.data``, unreadable)."""
    try:
        fd = os.open(checkpoint, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < 8:
            return {}
        with mmap.mmap(fd, min(st.st_size, MAX_FLATBUFFER_SIZE), access=mmap.ACCESS_READ) as mm:
            index = CheckpointIndex(mm, checkpoint)
    except (OSError, ValueError, CheckpointError):
        return {}
    finally:
        os.close(fd)
    recorded = index.checksums
    if recorded is None or not recorded.usable:
        return {}
    return {i.name: Slot(i.offset, i.nbytes, int(i.dtype), i.shape, recorded.digests[index.keys[id(i)]])
            for i in index.frozen.values() if i.storage == "external" and index.keys.get(id(i)) in recorded.digests}
