"""Checking a checkpoint's tensors against the checksums its file records (``_checksums``): each tensor once, read a
chunk at a time into one buffer (never mapped: a mapped page read stays in the process's memory), or hashed from the
memory a full load read it into; large checkpoints on two threads."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ..errors import CorruptCheckpointError
from . import _checksums
from ._diskio import _pread_into
from ._files import CheckpointFiles
from ._index import CheckpointIndex, TensorInfo
from ._platform import portable_io

_VERIFY_CHUNK = 1 << 20  # what verification reads at a time, into one buffer per thread
PARALLEL_VERIFY_BYTES = 256 << 20  # below this, one thread verifies: starting another costs more than it saves


class Verification:
    """The checksum checks of one open checkpoint. ``own`` maps a tensor (``id`` of its info) to the bytes a full
    load read it into (shared with the reader, which fills it). ``heal`` is asked for a tensor whose bytes do not
    match, with its recorded checksum: True when it found them intact elsewhere (another copy of a shared
    ``.data``), which then count."""

    def __init__(self, index: CheckpointIndex, files: CheckpointFiles, own: dict[int, np.ndarray],
                 heal: Callable[[TensorInfo, int | None], bool] | None = None) -> None:
        self.checksums = index.checksums
        self._heal = heal
        self._keys = index.keys
        self._files = files
        self._own = own
        self._verified: set[int] = set()
        self.path = files.path

    @property
    def usable(self) -> bool:
        """Whether the file records checksums this version can check."""
        return self.checksums is not None and self.checksums.usable

    def status(self) -> str:
        """In words: whether this file's tensors can be verified, and if not, why."""
        r = self.checksums
        if r is None:
            return "no checksums (not written by lightning-ort-ckpt, e.g. by ONNX Runtime)"
        if r.algorithm != _checksums.ALGORITHM:
            return f"checksums of an unknown algorithm {r.algorithm!r}: not checked"
        if r.stale is not None:
            return f"checksums not checked: {r.stale}"
        return f"{r.algorithm} checksums of {len(r.digests)} tensors"

    def tensor(self, info: TensorInfo) -> None:
        """Raise :class:`CorruptCheckpointError` naming the tensor when its bytes do not match the checksum recorded
        at save time (once per tensor); a no-op for a file without (usable) checksums."""
        if not self.usable or id(info) in self._verified:
            return
        if info.storage in ("inline", "external"):
            self.compare(info, self._digest(info))
        self.done(info)

    def done(self, info: TensorInfo) -> None:
        """Count ``info`` as verified (its bytes were found intact, here or in another copy)."""
        self._verified.add(id(info))

    def all(self, infos: list[TensorInfo]) -> None:
        """Check every tensor of ``infos`` (see :meth:`tensor`), so memory holds a chunk per thread whatever the
        file's size. Large checkpoints are hashed on two threads (the reads and the hash release the GIL), each
        taking the next tensor in turn."""
        if not self.usable:
            return
        if sum(i.nbytes for i in infos) < PARALLEL_VERIFY_BYTES:
            for info in infos:
                self.tensor(info)
            return
        work = iter(sorted(infos, key=lambda i: i.storage == "external"))  # the main file's tensors first
        take = threading.Lock()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                while not errors:
                    with take:
                        info = next(work, None)
                    if info is None:
                        return
                    self.tensor(info)
            except BaseException as e:  # noqa: BLE001 - raised below, on the caller's thread
                errors.append(e)

        helper: threading.Thread | None = threading.Thread(target=run, name="ort-ckpt-verify", daemon=True)
        try:
            helper.start()  # type: ignore[union-attr]
        except RuntimeError:  # interpreter shutting down: this thread does it all
            helper = None
        run()
        if helper is not None:
            helper.join()
        if errors:
            raise errors[0]

    def _digest(self, info: TensorInfo) -> int:
        """The checksum of the tensor's bytes: from its own memory while a full load runs, else read from the file
        a chunk at a time into one buffer (never mapped: a mapped page read stays in this process's memory)."""
        h = _checksums.hasher(int(info.dtype), info.shape)
        own = self._own.get(id(info))
        if own is not None:
            h.update(own)
            return h.intdigest()
        fd, path = self._files.source(info)
        buf = memoryview(bytearray(min(info.nbytes, _VERIFY_CHUNK)))
        pos, stop = info.offset, info.offset + info.nbytes
        while pos < stop:
            n = _pread_into(fd, buf[:min(len(buf), stop - pos)], pos, portable_io())
            if n == 0:
                raise CorruptCheckpointError(f"file ended early at byte {pos:,} (it shrank while being read)", path)
            h.update(buf[:n])
            pos += n
        return h.intdigest()

    def digest(self, info: TensorInfo) -> int | None:
        """The checksum recorded for ``info`` (None where the file records none for it)."""
        return self.checksums.digests.get(self._keys[id(info)]) if self.usable else None  # type: ignore[union-attr]

    def compare(self, info: TensorInfo, found: int) -> None:
        """Raise our error naming the tensor unless ``found`` is the checksum recorded for it, or ``heal`` found its
        bytes intact in another copy."""
        if found != self.checksums.digests[self._keys[id(info)]] and not (  # type: ignore[union-attr]
                self._heal is not None and self._heal(info, self.digest(info))):
            where = f" (in {self._files.data_path})" if info.storage == "external" else ""
            what = {"momentum": "optimizer state", "trainable": "parameter", "frozen": "parameter or buffer"}
            name = self._keys[id(info)].split(":", 1)[1]
            again = (" (and no other copy of this shared .data holds it intact)"
                     if self._heal is not None and info.kind == "frozen" and where else "")
            raise CorruptCheckpointError(f"{what[info.kind]} {name!r}{where} is damaged: its bytes (or type or shape) "
                                         f"do not match the checksum recorded when it was saved{again}", self.path)
