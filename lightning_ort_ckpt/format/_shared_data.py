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

This module says what a save shares (:class:`SharedFrozen`) and what it wrote (:class:`SavedData`); deciding which
tensors are unchanged is the caller's (``lightning_ort_ckpt._sharing``); planning and streaming are the writer's.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..errors import CheckpointSaveError
from . import _checksums

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

    def __init__(self, path: str, names: list[str]) -> None:
        why = (f"frozen tensor {names[0]!r} ({len(names)} in all) changed although its version did not" if names
               else "the shared .data file cannot be linked here")
        super().__init__(why, path)
        self.names = names


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
            h = _checksums.hasher(dtype, dims)
            pos, end = offset, offset + nbytes
            while pos < end:
                n = _read_at(fd, view[:min(len(buf), end - pos)], pos)
                if n <= 0:
                    break
                h.update(view[:n])
                pos += n
            if pos < end or h.intdigest() != digests[key]:
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
            f"{', '.join(os.path.basename(p) for p in sharing)}")
