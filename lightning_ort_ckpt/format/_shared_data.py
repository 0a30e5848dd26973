"""A ``.data`` file of frozen tensors that several checkpoints share by hard link.

ORT reads each external tensor from ``<checkpoint path>.data`` at the tensor's own ``external_data_offset``; nothing
else ties a file to its ``.data`` (no name, size or hash inside). So when a save finds its frozen tensors unchanged
since the previous save, its ``.data`` can be a second name (a hard link) of the previous save's ``.data``: the new
checkpoint's main file points its frozen tensors at the same offsets, and only the main file (trainable parameters,
optimizer state, changed buffers, metadata) is written. Where the file system offers copy-on-write clones (the
``FICLONE`` ioctl: XFS, Btrfs), the new ``.data`` is a clone instead: the blocks are shared, the inode is not, so no
write through another name can reach it. Every file stays whole: deleting or replacing one name of a shared
``.data`` leaves the inode to the others. A shared ``.data`` is never opened for writing again; it is made
read-only when written, so that ONNX Runtime's own ``save_checkpoint`` to such a path fails instead of changing the
file under the other checkpoints. A process running as root is not stopped by the mode, nor is ``truncate`` or ``cp``
over one name: that damage is bounded by the redundancy ``_sharing`` keeps (every frozen byte in two independent
files, one of them under a hidden reserve name (:func:`keep_reserve`) where retention deleted every checkpoint of it)
and found by :func:`verify_data` before anything links to the file again; :func:`write_copy` writes the
independent copies (new blocks, never a clone, read back before use); :func:`damage_note` names the checkpoints one
damaged file takes with it (docs/format.md).

The writer's side and the reader's side of a shared ``.data`` live here together. A save is told what it shares
(:class:`SharedFrozen`, decided once by the caller, ``lightning_ort_ckpt._sharing``: which tensors, linked from
which copy); the writer plans and streams, and :func:`carried_out` confirms the linked bytes and says what the save
put there (:class:`SavedData`). A read whose checksum fails on a frozen tensor takes its bytes from another copy
(:class:`OtherCopies`; the reader keeps them in a :class:`Healing`), and :func:`repair` writes a fresh copy from
good bytes and relinks the checkpoints that pointed at a damaged one (the save that finds damage, ``ort-ckpt verify
--repair``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointError, CheckpointSaveError, CheckpointWarning
from . import _checksums
from ._flatbuffers import MAX_FLATBUFFER_SIZE
from ._index import CheckpointIndex, TensorInfo

Identity = tuple[int, int, int, int]
"""A ``.data`` file as ``(st_dev, st_ino, st_size, st_mtime_ns)``: the inode that a link must reach. The size and
modification time (which links, renames and mode changes leave alone) tell a reused inode number from ours."""


@dataclass(frozen=True)
class SharedFrozen:
    """The frozen tensors a save keeps in ``.data``.

    Without ``link_from``, a fresh ``.data`` holding ``names`` (sorted, aligned as ORT aligns) is written, read-only.
    With it, ``.data`` is a hard link to ``link_from``, which must still be the inode ``identity``; ``names`` map to
    their offsets there and ``digests`` (checksum key -> XXH3-64) to what the tensors' bytes hashed to when it was
    written. Before the commit the writer hashes the tensors again (while it writes the rest), except those in
    ``trusted`` (whose recorded digests are taken as they are: the caller vouches for them); one whose bytes
    differ raises :class:`NotShared` (nothing is committed), unless ``changed_since_asked`` says it changed only
    after the save was asked for (an asynchronous save reading the live tensor: the linked bytes are then the right
    ones). Where the link cannot be made (another file system, no hard links) it raises :class:`NotShared` before
    writing anything. Either way the caller saves again with a :meth:`fresh` one.
    """

    names: dict[str, int]
    link_from: str | None = None
    identity: Identity | None = None
    digests: dict[str, int] = field(default_factory=dict)
    trusted: frozenset[str] = frozenset()
    changed_since_asked: Callable[[str], bool] | None = None

    @classmethod
    def fresh(cls, names: Iterable[str]) -> SharedFrozen:
        """The tensors ``names``, written to a fresh ``.data``."""
        return cls({n: -1 for n in names})

    def rehash(self, name: str, key: str | None) -> bool:
        """Whether the writer hashes the linked tensor ``name`` (checksum key ``key``) again: unless the caller
        trusts it and its digest was recorded."""
        return name not in self.trusted or key not in self.digests


@dataclass(frozen=True)
class SavedData:
    """What a sharing save put in ``.data``: whether it linked, the inode, each tensor's offset and digest (empty
    digests when checksums are off), and each tensor's ``(type code, dims, bytes)`` (what :func:`verify_data` needs
    to hash it again from the file)."""

    linked: bool
    identity: Identity
    offsets: dict[str, int]
    digests: dict[str, int]
    layout: dict[str, tuple[int, tuple[int, ...], int]] = field(default_factory=dict)


class NotShared(CheckpointSaveError):
    """The linked ``.data`` cannot be used: no link could be made (``names`` empty), or the tensors ``names`` no
    longer have the bytes they have there (changed without a version counter seeing it). Nothing was committed:
    save again with a fresh ``.data``."""

    def __init__(self, path: str, names: list[str], why: str = "") -> None:
        why = why or (f"frozen tensor {names[0]!r} ({len(names)} in all) changed although its version did not"
                      if names else "the shared .data file cannot be linked here")
        super().__init__(why, path)
        self.names = names


class SharedTooLarge(NotShared):
    """Everything but the shared frozen tensors kept inline would pass the FlatBuffers 2 GiB limit: the plan cannot
    be carried out. Nothing was written; the caller saves as ``external_data="auto"`` does without sharing."""

    def __init__(self, path: str) -> None:
        super().__init__(path, [], "the checkpoint would pass 2 GiB with everything but the shared frozen tensors "
                                   "inline")


def carried_out(shared: SharedFrozen, linked: list[tuple[str, str | None, bool]], digests: dict[str, int],
                is_link: bool, data: int | None, offsets: dict[str, int],
                layout: dict[str, tuple[int, tuple[int, ...], int]], path: str) -> SavedData:
    """The end of a sharing save, before its commit: the linked tensors (name, checksum key, whether the writer hashed
    them again) confirmed to hold the linked bytes, :class:`NotShared` where one does not (unless it changed only
    after the save was asked for); ``digests`` (the hashes just computed) get the recorded ones of the linked tensors;
    a fresh ``.data`` (the open file ``data``) made read-only; and what the save put there."""
    changed = []
    for name, key, hashed in linked:
        if key not in digests:
            continue
        if hashed and digests[key] != shared.digests.get(key) and (
                shared.changed_since_asked is None or not shared.changed_since_asked(name)):
            changed.append(name)
        digests[key] = shared.digests.get(key, digests[key])
    if changed:
        raise NotShared(path, changed)
    if data is not None:
        with contextlib.suppress(OSError, NotImplementedError, AttributeError):
            os.fchmod(data, 0o444)  # never written again: see the module's doc
    inode = shared.identity if is_link else identity(os.fstat(data))  # type: ignore[arg-type]
    keys = [_checksums.param_key(n) for n in offsets]
    return SavedData(is_link, inode, offsets, {k: digests[k] for k in keys if k in digests},  # type: ignore[arg-type]
                     layout)


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


RESERVE_PREFIX = ".ort_ckpt.reserve-"
"""How a reserve's name starts: a hidden second name (a hard link, in the same folder) that keeps a shared ``.data``
whose last checkpoint retention deletes while other checkpoints link another copy (``lightning_ort_ckpt._sharing``).
It ends in neither ``.tmp`` nor ``.old``, so the sweep of leftovers leaves it alone; hidden and not ``*.ckpt``, so no
search for checkpoints (``ckpt_path="last"``, ``sharing_checkpoints``) finds it."""


def is_reserve(path: str) -> bool:
    """Whether ``path`` is a reserve name (:data:`RESERVE_PREFIX`)."""
    return os.path.basename(path).startswith(RESERVE_PREFIX)


def keep_reserve(data: str, expected: Identity) -> str | None:
    """A reserve name for the ``.data`` file ``data`` if it is still the inode ``expected``: a hard link made beside it
    (never opened, so never written through), or the one it has already; None where no link can be made."""
    try:
        st = os.stat(data, follow_symlinks=False)
    except OSError:
        return None
    if identity(st) != expected:
        return None
    name = os.path.join(os.path.dirname(data), f"{RESERVE_PREFIX}{st.st_dev:x}-{st.st_ino}.data")
    try:
        os.link(data, name, follow_symlinks=False)
    except FileExistsError:  # this inode has one already (the name holds the inode: no other file has its number)
        pass
    except (OSError, NotImplementedError):
        return None
    try:
        return name if identity(os.stat(name, follow_symlinks=False)) == expected else None
    except OSError:
        return None


def looked_at(path: str) -> os.stat_result | None:
    """The name ``path`` as it is now, its symbolic link not followed (None where nothing is there): how sharing
    tells a ``.data`` name's inode, change time and link count (``lightning_ort_ckpt._frozen_copies``)."""
    try:
        return os.stat(path, follow_symlinks=False)
    except OSError:
        return None


def drop_name(path: str) -> None:
    """Delete the hidden name ``path`` (a reserve, or a copy written ahead that no save linked); one already gone is
    fine. The inode goes with its last name: a checkpoint's names keep it."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def reserves(directory: str) -> list[str]:
    """The reserve names in ``directory`` (those of an earlier run included)."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        return sorted(e.path for e in entries if e.name.startswith(RESERVE_PREFIX))
    return []


def sharing_checkpoints(path: str, suffix: str = ".ckpt") -> list[str]:
    """The checkpoints (``*<suffix>`` in the folder of ``path``, ``path`` included) whose ``.data`` is the very
    file (inode) ``path``'s is: the ones one damaged shared file takes with it. [] when it has no ``.data``."""
    try:
        mine = os.stat(path + ".data")
    except OSError:
        return []
    directory = os.path.dirname(os.path.abspath(path))
    found = []
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(suffix):
                continue
            with contextlib.suppress(OSError):
                st = os.stat(entry.path + ".data")
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    found.append(entry.path)
    return sorted(found)


def damage_note(path: str, error: str) -> str:
    """For an error of checkpoint ``path`` (its message ``error``) whose damage lies in a ``.data`` file other
    checkpoints share: a sentence naming the file and every checkpoint it takes with it; "" otherwise."""
    data = path + ".data"
    if data not in error:
        return ""
    sharing = sharing_checkpoints(path, os.path.splitext(path)[1] or ".ckpt")
    if len(sharing) < 2:
        return ""
    return (f"{data} is a shared .data (hard links): the {len(sharing)} checkpoints sharing it are damaged with it: "
            f"{', '.join(os.path.basename(p) for p in sharing)} (`ort-ckpt verify --repair` rewrites it from the "
            "other copy where that one holds the damaged tensors intact)")


# -- healing: reading a damaged shared .data's tensors from the other copy, and repairing it -----------------------
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


def _read_slot(fd: int, slot: Slot) -> bytearray | None:
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
            found = _read_slot(peer.fd, where)
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
        seen = {_inode(self.path + ".data")}
        names = []
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            names = sorted(e.path for e in entries if not e.name.startswith(".") and e.name.endswith(suffix))
        for checkpoint in [*names, *reserves(directory)]:
            reserve = is_reserve(checkpoint)
            data = checkpoint if reserve else checkpoint + ".data"
            inode = _inode(data)
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


def _inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


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


@dataclass(frozen=True)
class Repaired:
    """What :func:`repair` did for one damaged ``.data`` file (inode): the checkpoints it relinked to a fresh copy
    written from good bytes, the tensors it took from another copy, or, where some tensor is damaged in every
    copy, those (``lost``) and nothing changed."""

    damaged: str
    checkpoints: list[str]
    tensors: list[str]
    lost: list[str] = field(default_factory=list)


def repair(checkpoints: Iterable[str]) -> list[Repaired]:
    """Make every checkpoint of ``checkpoints`` whose ``.data`` holds a damaged frozen tensor whole again: per
    damaged inode, a fresh copy is written (its good bytes, and the damaged tensors' bytes from another copy,
    :class:`OtherCopies`), made durable and read-only, read back against the checksums, and then each checkpoint's
    ``.data`` name is replaced by a link to it (atomically; a checkpoint that verifies keeps its file). The
    checkpoints other than these that link the damaged inode are left alone."""
    groups: dict[tuple[int, int], list[tuple[str, dict[str, Slot], list[str]]]] = {}
    for path in checkpoints:
        slots = recorded_slots(path)
        inode = _inode(path + ".data")
        if not slots or inode is None:
            continue
        bad = _damaged(path + ".data", slots)
        if bad:
            groups.setdefault(inode, []).append((path, slots, bad))
    return [_repair_one(inode, group) for inode, group in groups.items()]


def _damaged(data: str, slots: dict[str, Slot]) -> list[str]:
    """The tensors of ``slots`` whose bytes in ``data`` no longer match their checksum (all where it cannot be
    opened)."""
    try:
        fd = os.open(data, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return sorted(slots)
    try:
        buf = memoryview(bytearray(16 << 20))
        return sorted(n for n, s in slots.items() if digest_at(fd, s, buf) != s.digest)
    finally:
        os.close(fd)


def _repair_one(inode: tuple[int, int], group: list[tuple[str, dict[str, Slot], list[str]]]) -> Repaired:
    data = group[0][0] + ".data"
    slots = {n: s for _, found, _ in group for n, s in found.items()}
    bad = sorted({n for _, _, b in group for n in b})
    directory = os.path.dirname(os.path.abspath(data))
    others = OtherCopies(group[0][0])
    good: dict[str, bytearray] = {}
    try:
        for name in bad:
            found = others.read(name, slots[name])
            if found is not None:
                good[name] = found[0]
    finally:
        others.close()
    lost = [n for n in bad if n not in good]
    if lost:
        return Repaired(data, [], [], lost)
    fd, fresh = tempfile.mkstemp(prefix=".ort_ckpt.repair-", suffix=".tmp", dir=directory)
    try:
        _write_repaired(fd, data, slots, good)
    finally:
        os.close(fd)
    try:
        if _damaged(fresh, slots):  # pragma: no cover - what was just written and synced reads back different
            raise CheckpointSaveError("the repaired copy did not read back as written", data)
        relinked: list[str] = []
        for path, _, _ in group:
            target = path + ".data"
            if _inode(target) != inode:
                continue  # replaced meanwhile (a save): not ours to touch
            tmp = os.path.join(directory, f".ort_ckpt.relink-{os.getpid()}-{len(relinked)}.tmp")
            os.link(fresh, tmp)
            os.replace(tmp, target)
            relinked.append(path)
        _sync_directory(directory)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(fresh)
    return Repaired(data, relinked, bad)


def _write_repaired(fd: int, damaged: str, slots: dict[str, Slot], good: dict[str, bytearray]) -> None:
    """Write the fresh copy into ``fd``: zeros where nothing lies (the writer's padding), each tensor's good bytes
    (from the damaged file where they still match, else ``good``), durable and read-only."""
    os.ftruncate(fd, max(s.offset + s.nbytes for s in slots.values()))
    src = os.open(damaged, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        for name, slot in sorted(slots.items(), key=lambda item: item[1].offset):
            found = good.get(name)
            if found is None:
                found = _read_slot(src, slot)
            if found is None:  # pragma: no cover - damaged between the check and now
                raise CheckpointSaveError(f"frozen tensor {name!r} changed while it was being repaired", damaged)
            view, pos = memoryview(found), 0
            while pos < len(view):
                pos += os.pwrite(fd, view[pos:], slot.offset + pos)
    finally:
        os.close(src)
    os.fsync(fd)
    os.fchmod(fd, 0o444)


def _sync_directory(directory: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
