"""Repair: a fresh copy of a damaged shared ``.data`` written from good bytes, its checkpoints relinked."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field

from ...errors import CheckpointSaveError
from ._healing import OtherCopies, recorded_slots
from ._links import Slot, digest_at, inode_of, read_slot


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
        inode = inode_of(path + ".data")
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
            if inode_of(target) != inode:
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
                found = read_slot(src, slot)
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
