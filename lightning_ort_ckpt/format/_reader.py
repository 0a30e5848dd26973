"""Reads ODTC files: validates every offset before trusting it, then gives lazy, zero-copy access to tensors.

:class:`CheckpointReader` opens the file and its ``.data`` (``_files``: one consistent pair, the FlatBuffer mapped,
the ``.data`` checked to be present, long enough and in the checkpoint's directory) and parses only the metadata
(``_index``: names, dims, offsets, each checked against the file). Any fault raises :class:`CorruptCheckpointError`
naming the file and the fault. Tensor bytes are touched only when asked for, so one tensor of a 10 GB checkpoint costs
one tensor's reads; a full load (:meth:`load <CheckpointReader.load>`) reads each tensor into memory of its own.
Files written by this library record a checksum of every tensor (``checksums``): a full load verifies them all, the
lazy reader on request, reading a chunk at a time.

torch is imported only when tensors are requested. Where it is not installed, tensors come back as numpy arrays
(:meth:`get_tensor <CheckpointReader.get_tensor>`, :meth:`load <CheckpointReader.load>`, :func:`load_checkpoint`):
the format layer needs numpy only.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from . import _checksums
from ._contents import CheckpointContents, OptimizerGroup
from ._diskio import _pread_into, read_range
from ._dtypes import DataType
from . import _verification
from ._files import CheckpointFiles
from ._index import Described, GroupInfo, TensorInfo
from ._platform import portable_io
from ._shared_data import Healing
from ._verification import Verification

__all__ = ["CheckpointReader", "GroupInfo", "TensorInfo", "load_checkpoint", "open_checkpoint"]

class CheckpointReader(Described):
    """An open ODTC checkpoint: its index (what tensors it holds, where) and the reading of their bytes, as views,
    copies or verified against their checksums. Use as a context manager; tensors it returned stay valid after
    :meth:`close`."""

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False, heal: bool = True) -> None:
        """``verify=True`` checks each tensor against its recorded checksum when it is read (:meth:`verify_tensor`).
        A FlatBuffer ends before 2 GiB: a tail beyond is never mapped nor read. ``heal`` (the default): a frozen
        tensor damaged in a shared ``.data`` is read from another copy whose bytes match its checksum
        (``_shared_data.OtherCopies``), with one warning naming the damaged file; ``heal=False`` raises instead."""
        self.path = os.fspath(path)
        self._verify = verify
        self._own: dict[int, np.ndarray] = {}  # tensor bytes read by load(), each in memory of its own
        self._healing = Healing(self.path)  # tensors read from another copy; its files opened only where needed
        self._files = CheckpointFiles(self.path)
        try:
            self._index = index = self._files.index(short_ok=heal)
            self._keys = index.keys
            # Healing.heal, not a method of this reader: the reader must not be in a reference cycle, or it (and
            # its mapping of the file, with every page a lazy read touched) outlives its last use until a gc runs
            self._checks = Verification(index, self._files, self._own, self._healing.heal if heal else None)
            size = self._files.data_size
            for info in index.external:  # past the end of a truncated .data: only another copy has these
                if size is not None and info.offset + info.nbytes > size:
                    if not self._healing.heal(info, self._checks.digest(info)):
                        index.check_data_size(size, self._files.data_path)
                    self._checks.done(info)
        except BaseException:
            self.close()
            raise
        self.version, self.nominal, self.has_external_data = index.version, index.nominal, index.has_external_data
        self.trainable, self.frozen, self.optimizer_groups = index.trainable, index.frozen, index.optimizer_groups
        self.properties, self.checksums = index.properties, index.checksums

    @property
    def healed(self) -> list[tuple[str, str]]:
        """The frozen tensors whose bytes were damaged in this checkpoint's shared ``.data`` and were read from
        another copy instead, each with the file it was read from."""
        return self._healing.healed

    @property
    def data_path(self) -> str:
        return self._files.data_path

    def tensors(self) -> list[TensorInfo]:
        """Every tensor: trainable, frozen, then optimizer momentums."""
        return self._index.tensors()

    def checksum_status(self) -> str:
        """In words: whether this file's tensors can be verified, and if not, why."""
        return self._checks.status()

    def verify_tensor(self, info: TensorInfo) -> None:
        """Raise :class:`CorruptCheckpointError` naming the tensor when its bytes do not match the checksum recorded
        at save time. Reads the tensor's bytes; a no-op for a file without (usable) checksums."""
        self._checks.tensor(info)

    def verify(self) -> None:
        """Check every tensor against its recorded checksum (see :meth:`verify_tensor`), each read a chunk at a time
        into one buffer (no tensor is mapped), on two threads for a large checkpoint (``_verification``)."""
        self._checks.all(self.tensors())

    def get_tensor(self, name: str) -> Any:
        """A parameter or buffer as a torch tensor, zero-copy from the file where alignment allows; where torch is
        not installed, as a numpy array (see :meth:`numpy`)."""
        info = self.trainable.get(name) or self.frozen.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no parameter named {name!r}")
        return self.torch(info) if _has_torch() else self.numpy(info)

    def torch(self, info: TensorInfo) -> Any:
        """The tensor ``info`` describes. Writes to it never reach the file (the mapping is copy-on-write)."""
        import torch

        dtype = self._checked_dtype(info).to_torch()
        if self._verify:
            self.verify_tensor(info)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        # Through numpy: the array holds a buffer export on the mapping, and the tensor holds the array, so the
        # mapping outlives close() for as long as any tensor uses it (torch.frombuffer would not keep it alive).
        raw = self._raw(info)
        if raw.ctypes.data % info.dtype.itemsize:  # ORT leaves int64/double data 4-aligned: copy those
            raw = raw.copy()
        return torch.from_numpy(raw).view(dtype).reshape(info.shape)

    def numpy(self, info: TensorInfo) -> np.ndarray:
        """The tensor as a read-only numpy array (bfloat16 and float8 come back as raw unsigned ints)."""
        if info.storage == "strings":
            return np.array(self._strings(info), dtype=object).reshape(info.shape)
        dtype = self._checked_dtype(info).to_numpy()
        if self._verify:
            self.verify_tensor(info)
        if info.nbytes == 0:
            return np.empty(info.shape, dtype=dtype)
        return self._raw(info).view(dtype).reshape(info.shape)

    def read_bytes(self, info: TensorInfo, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor's bytes (uint8) read into memory of their own (or into ``out``, a writable uint8 array of
        ``info.nbytes``: a load's target tensor), never mapped, so nothing of the file stays in this process once
        the array goes: a sharded checkpoint's reader and its consolidation read one tensor at a time this way.
        Checked against the recorded checksum when the reader verifies."""
        self._checked_dtype(info)
        if self._healing.has(info):
            return self._healing.into(info, out)
        fd, path = self._files.source(info)
        if out is None:
            own = (read_range(fd, info.offset, info.nbytes, path, self._files.direct(fd)) if info.nbytes
                   else np.empty(0, np.uint8))
        else:
            own, view, pos = out, out.data.cast("B"), 0
            if len(view) != info.nbytes:
                raise ValueError(f"{info.name!r} has {info.nbytes} bytes, not {len(view)}")
            while pos < info.nbytes:
                n = _pread_into(fd, view[pos:], info.offset + pos, portable_io())
                if n == 0:
                    raise CorruptCheckpointError(f"file ended early at byte {info.offset + pos:,}", path)
                pos += n
        if self._verify and self._checks.usable:
            h = _checksums.hasher(int(info.dtype), info.shape)
            h.update(own)
            self._checks.compare(info, h.intdigest())
            if self._healing.has(info):
                return self._healing.into(info, out)
        return own

    def load(self, verify: bool = True) -> CheckpointContents:
        """Everything, as a :class:`CheckpointContents` of torch tensors (numpy arrays where torch is not installed), each in
        memory of its own (nothing left mapped).

        Each tensor is read from the file straight into memory of its own, in file order (``diskio.read_range``):
        no buffer ever holds the whole file, and a tensor kept alive keeps only its own bytes alive (the optimizer
        moments torch keeps after a resume do not keep the parameters' bytes with them). With ``verify`` every
        tensor is checked against its recorded checksum before any is handed out. A large checkpoint is read on two
        threads, each reading a tensor and then hashing it while its bytes are still in the CPU's cache: two reads
        are in flight at once (a disk serves them together faster than one after the other) and the hashing hides
        under the other thread's read (the reads and the hash release the GIL).
        """
        stored = sorted((i for i in self.tensors() if i.storage in ("inline", "external")),
                        key=lambda i: (i.storage, i.offset))
        for before, info in zip(stored, stored[1:]):  # each is read into memory of its own: never one byte twice
            if info.storage == before.storage and info.offset < before.offset + before.nbytes:
                raise self._fail(f"{info.kind} tensor {info.name!r} shares bytes with {before.kind} tensor "
                                 f"{before.name!r}; no checkpoint is written that way: it is damaged")
        stored = [i for i in stored if not self._healing.has(i)]
        overlap = sum(i.nbytes for i in stored) >= _verification.PARALLEL_VERIFY_BYTES
        reading = concurrent.futures.ThreadPoolExecutor(2, "ort-ckpt-read") if overlap else None
        try:
            if reading is None:
                for info in stored:
                    self._read_own(info, False)
            else:
                pending = [reading.submit(self._read_own, info, verify) for info in stored]
                for done in concurrent.futures.as_completed(pending):
                    done.result()  # a damaged tensor stops the load at once, not after the last read
            if verify:
                self.verify()  # what is left: everything for a small checkpoint, nothing for a large one
            tensor = self.torch if _has_torch() else self.numpy
            fresh = {id(i): self.numpy(i) if i.storage == "strings" else self._empty(i) if i.storage == "none"
                     else tensor(i) for i in self.tensors()}
        finally:
            if reading is not None:
                reading.shutdown(cancel_futures=True)
            self._own.clear()  # the tensors hold their memory now; a reader kept open must not
        return CheckpointContents(
            trainable={n: fresh[id(i)] for n, i in self.trainable.items()},
            frozen={n: fresh[id(i)] for n, i in self.frozen.items()},
            optimizer_groups={g.name: OptimizerGroup(g.step, g.initial_learning_rate,
                                                     {p: {m: fresh[id(i)] for m, i in ms.items()}
                                                      for p, ms in g.states.items()})
                              for g in self.optimizer_groups.values()},
            properties=dict(self.properties), nominal=self.nominal)

    def _read_own(self, info: TensorInfo, verify: bool) -> None:
        """Read ``info``'s bytes into memory of their own for :meth:`load` (and check them, with ``verify``)."""
        fd, path = self._files.source(info)
        self._own[id(info)] = read_range(fd, info.offset, info.nbytes, path, self._files.direct(fd))
        if verify:
            self.verify_tensor(info)

    def module_state(self) -> CheckpointContents:
        """The parameters, buffers and properties, and the optimizer groups without their tensors, as zero-copy
        views of the mapped file (each checked against its checksum as it is read when the reader verifies): what an
        export needs, at the cost of the module's bytes only; none of the optimizer's bytes are read."""
        return CheckpointContents(trainable={n: self.torch(i) for n, i in self.trainable.items()},
                          frozen={n: self.torch(i) for n, i in self.frozen.items()},
                          optimizer_groups={g.name: OptimizerGroup(g.step, g.initial_learning_rate)
                                            for g in self.optimizer_groups.values()},
                          properties=dict(self.properties), nominal=self.nominal)

    @staticmethod
    def _empty(info: TensorInfo) -> Any:
        """A nominal checkpoint's tensor: the dtype is all there is."""
        if not _has_torch():
            return np.empty(0, dtype=info.dtype.to_numpy())
        import torch

        return torch.empty(0, dtype=info.dtype.to_torch())


    def close(self) -> None:
        self._files.close()
        self._healing.close()

    def _fail(self, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(message, self.path)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes: read from another copy (healed), its own memory while :meth:`load` runs, else a view
        of the mapped file."""
        own = self._healing.bytes.get(id(info))
        if own is not None:
            return own
        own = self._own.get(id(info))
        if own is not None:
            return own
        return np.frombuffer(self._files.mapped(info, self._index), dtype=np.uint8, count=info.nbytes,
                             offset=info.offset)

    # -- data access --------------------------------------------------------------------------------------------
    def _checked_dtype(self, info: TensorInfo) -> DataType:
        if info.storage == "none":
            raise CorruptCheckpointError(f"{info.kind} tensor {info.name!r} has no data: this is a nominal "
                                         "checkpoint (names and types only)", self.path)
        if info.storage == "strings":
            raise CorruptCheckpointError(f"{info.kind} tensor {info.name!r} holds strings; use numpy()", self.path)
        return info.dtype

    def _strings(self, info: TensorInfo) -> list[str]:
        return self._index.strings(info)


def open_checkpoint(path: str | os.PathLike[str], *, verify: bool = False) -> CheckpointReader:
    """Open ``path`` for lazy access; see :class:`CheckpointReader` (``verify=True``: each tensor is checked against
    its checksum when it is read)."""
    return CheckpointReader(path, verify=verify)


def load_checkpoint(path: str | os.PathLike[str], *, verify: bool = True) -> CheckpointContents:
    """Read the whole checkpoint at ``path`` into torch tensors, each in memory of its own (see
    :meth:`CheckpointReader.load`). Large tensors leave the page cache as they are copied, and their uncached part is
    read straight from the disk into their memory (see ``diskio.read_range``). With ``verify``
    (the default) every tensor must match the checksum recorded when it was saved, or
    :class:`CorruptCheckpointError` names it; files without checksums (written by ORT) load as they are."""
    with CheckpointReader(path) as reader:
        return reader.load(verify)


def _has_torch() -> bool:
    """Whether torch can be imported: tensors are torch's where it can, numpy's where it cannot."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True
