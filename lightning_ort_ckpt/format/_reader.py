"""Reads ODTC files: validates every offset before trusting it, then gives lazy, zero-copy access to tensors.

:class:`CheckpointReader` memory-maps the file and parses only the metadata (names, dims, offsets), checking the
identifier, the version, that every offset and length is inside the file, that dims are non-negative and that
``numel x itemsize`` equals the stored length (Python integers: no overflow), and that an external ``.data`` file is
present, long enough and in the checkpoint's directory. Any fault raises :class:`CorruptCheckpointError` naming the
file and the fault; nothing is allocated from a size the file claims before that size is checked against the file. Tensor bytes are touched only
when asked for, so one tensor of a 10 GB checkpoint costs one tensor's reads; a full load (:meth:`load
<CheckpointReader.load>`) reads each tensor into memory of its own. Files written by this library record a checksum
of every tensor (``checksums``): a full load verifies them all, the lazy reader on request, reading a chunk at a
time.

torch is imported only when tensors are requested. Where it is not installed, tensors come back as numpy arrays
(:meth:`get_tensor <CheckpointReader.get_tensor>`, :meth:`load <CheckpointReader.load>`, :func:`load_checkpoint`):
the format layer needs numpy only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import mmap
import os
import stat
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError
from . import _atomic, _checksums
from ._contents import CheckpointContents, OptimizerGroup, PropertyValue
from ._diskio import _pread_into, check_regular, open_regular, read_range
from ._dtypes import DataType
from ._flatbuffers import MAX_FLATBUFFER_SIZE, Verifier
from ._platform import portable_io
from ._schema import (EXTERNAL_DATA_OFFSET_DEFAULT, FILE_IDENTIFIER, VERSION, CheckpointSlot, ModuleStateSlot, OptimizerGroupSlot, ParameterOptimizerStateSlot, PropertyBagSlot, PropertySlot, TensorSlot)

Storage = Literal["inline", "external", "strings", "none"]
Kind = Literal["trainable", "frozen", "momentum"]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are and what they mean.

    ``offset`` is the byte offset of the data in the checkpoint (``storage == "inline"``) or in its ``.data`` file
    (``"external"``). ``"strings"`` is a STRING tensor; ``"none"`` a tensor of a nominal checkpoint without data.
    """

    name: str
    kind: Kind
    dtype: DataType
    shape: tuple[int, ...]
    nbytes: int
    storage: Storage
    offset: int
    doc_string: str | None = None
    string_offsets: tuple[int, ...] = ()


@dataclass(frozen=True)
class GroupInfo:
    """An optimizer group's scalars and its momentums: parameter name -> momentum name -> tensor."""

    name: str
    step: int
    initial_learning_rate: float
    states: dict[str, dict[str, TensorInfo]] = field(default_factory=dict)


class CheckpointReader:
    """An open ODTC checkpoint. Use as a context manager; tensors it returned stay valid after :meth:`close`."""

    def __init__(self, path: str | os.PathLike[str], *, verify: bool = False) -> None:
        """``verify=True`` checks each tensor against its recorded checksum when it is read (:meth:`verify_tensor`).
        A FlatBuffer ends before 2 GiB: a tail beyond is never mapped nor read."""
        self.path = os.fspath(path)
        self._verify = verify
        self._verified: set[int] = set()
        self._own: dict[int, np.ndarray] = {}  # tensor bytes read by load(), each in memory of its own
        self._fd = -1
        self._data_mm: Any = None
        self._mapping = threading.Lock()
        self._data: Any = None  # the .data file opened with the checkpoint, as one consistent pair
        try:
            fd, data_fd = _atomic.open_pair(self.path)  # changes nothing on disk, even mid-commit
            self._data = None if data_fd is None else os.fdopen(data_fd, "rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError):
            raise CorruptCheckpointError("no such checkpoint file", self.path) from None
        except OSError as e:  # permission denied, a symlink loop, ...
            raise CheckpointError(f"cannot open the checkpoint: {e.strerror or e}", self.path) from None
        self._fd = fd  # kept open for load(), which reads the tensors from it
        try:
            st = os.fstat(fd)
            check_regular(st.st_mode, "checkpoint", self.path)
            if st.st_size < 8:
                raise CorruptCheckpointError(f"not an ORT checkpoint: the file has only {st.st_size} bytes",
                                             self.path)
            self._mm: Any = _map(fd, min(st.st_size, MAX_FLATBUFFER_SIZE), self.path)
            with _parsing(self._mm):
                self._parse()
        except BaseException:
            self.close()
            raise
        if not self.has_external_data and self._data is not None:
            self._data.close()
            self._data = None

    # -- public -------------------------------------------------------------------------------------------------
    version: int
    nominal: bool
    has_external_data: bool
    trainable: dict[str, TensorInfo]
    frozen: dict[str, TensorInfo]
    optimizer_groups: dict[str, GroupInfo]
    properties: dict[str, PropertyValue]

    @property
    def data_path(self) -> str:
        return _atomic.data_path(self.path)

    def tensors(self) -> list[TensorInfo]:
        """Every tensor: trainable, frozen, then optimizer momentums."""
        out = [*self.trainable.values(), *self.frozen.values()]
        for group in self.optimizer_groups.values():
            for momentums in group.states.values():
                out.extend(momentums.values())
        return out

    checksums: _checksums.Recorded | None
    """The tensor checksums the file records (None for a file ORT wrote: it records none)."""

    def checksum_status(self) -> str:
        """In words: whether this file's tensors can be verified, and if not, why."""
        r = self.checksums
        if r is None:
            return "no checksums (not written by lightning-ort-ckpt, e.g. by ONNX Runtime)"
        if r.algorithm != _checksums.ALGORITHM:
            return f"checksums of an unknown algorithm {r.algorithm!r}: not checked"
        if r.stale is not None:
            return f"checksums not checked: {r.stale}"
        return f"{r.algorithm} checksums of {len(r.digests)} tensors"

    def verify_tensor(self, info: TensorInfo) -> None:
        """Raise :class:`CorruptCheckpointError` naming the tensor when its bytes do not match the checksum recorded
        at save time. Reads the tensor's bytes; a no-op for a file without (usable) checksums."""
        if self.checksums is None or not self.checksums.usable or id(info) in self._verified:
            return
        if info.storage in ("inline", "external"):
            self._compare(info, self._digest(info))
        self._verified.add(id(info))

    def verify(self) -> None:
        """Check every tensor against its recorded checksum (see :meth:`verify_tensor`), each read a chunk at a time
        into one buffer, so memory holds a chunk per thread whatever the file's size (no tensor is mapped). Large
        checkpoints are hashed on two threads (the reads and the hash release the GIL), each taking the next tensor
        in turn."""
        infos = self.tensors()
        if self.checksums is None or not self.checksums.usable:
            return
        if sum(i.nbytes for i in infos) < _PARALLEL_VERIFY_BYTES:
            for info in infos:
                self.verify_tensor(info)
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
                    self.verify_tensor(info)
            except BaseException as e:  # noqa: BLE001 - raised below, on the caller's thread
                errors.append(e)

        helper = threading.Thread(target=run, name="ort-ckpt-verify", daemon=True)
        try:
            helper.start()
        except RuntimeError:  # interpreter shutting down: this thread does it all
            helper = None
        run()
        if helper is not None:
            helper.join()
        if errors:
            raise errors[0]

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
        fd, path = (self._fd, self.path) if info.storage == "inline" else (self._data_fd(), self.data_path)
        if out is None:
            own = read_range(fd, info.offset, info.nbytes, path) if info.nbytes else np.empty(0, np.uint8)
        else:
            own, view, pos = out, memoryview(out).cast("B"), 0
            if len(view) != info.nbytes:
                raise ValueError(f"{info.name!r} has {info.nbytes} bytes, not {len(view)}")
            while pos < info.nbytes:
                n = _pread_into(fd, view[pos:], info.offset + pos, portable_io())
                if n == 0:
                    raise CorruptCheckpointError(f"file ended early at byte {info.offset + pos:,}", path)
                pos += n
        if self._verify and self.checksums is not None and self.checksums.usable:
            h = _checksums.hasher(int(info.dtype), info.shape)
            h.update(own)
            self._compare(info, h.intdigest())
        return own

    def load(self, verify: bool = True) -> CheckpointContents:
        """Everything, as a :class:`CheckpointContents` of torch tensors (numpy arrays where torch is not installed), each in
        memory of its own (nothing left mapped).

        Each tensor is read from the file straight into memory of its own, in file order (``diskio.read_range``):
        no buffer ever holds the whole file, and a tensor kept alive keeps only its own bytes alive (the optimizer
        moments torch keeps after a resume do not keep the parameters' bytes with them). With ``verify`` every
        tensor is checked against its recorded checksum before any is handed out; for a large checkpoint each
        tensor is hashed on a second thread as soon as it is read, while this one reads the next (the hash and the
        reads release the GIL), so verification hides under the reads instead of following them.
        """
        stored = sorted((i for i in self.tensors() if i.storage in ("inline", "external")),
                        key=lambda i: (i.storage, i.offset))
        for before, info in zip(stored, stored[1:]):  # each is read into memory of its own: never one byte twice
            if info.storage == before.storage and info.offset < before.offset + before.nbytes:
                raise self._fail(f"{info.kind} tensor {info.name!r} shares bytes with {before.kind} tensor "
                                 f"{before.name!r}; no checkpoint is written that way: it is damaged")
        overlap = (verify and self.checksums is not None and self.checksums.usable
                   and sum(i.nbytes for i in stored) >= _PARALLEL_VERIFY_BYTES)
        hashing = concurrent.futures.ThreadPoolExecutor(1, "ort-ckpt-verify") if overlap else None
        try:
            pending = []
            for info in stored:
                self._own[id(info)] = (read_range(self._fd, info.offset, info.nbytes, self.path)
                                       if info.storage == "inline"
                                       else read_range(self._data_fd(), info.offset, info.nbytes, self.data_path))
                if hashing is not None:
                    pending.append(hashing.submit(self.verify_tensor, info))
                    if pending[0].done():  # a damaged tensor stops the load at once, not after the last read
                        pending.pop(0).result()
            for done in pending:
                done.result()
            if verify:
                self.verify()  # what is left: everything for a small checkpoint, nothing for a large one
            tensor = self.torch if _has_torch() else self.numpy
            fresh = {id(i): self.numpy(i) if i.storage == "strings" else self._empty(i) if i.storage == "none"
                     else tensor(i) for i in self.tensors()}
        finally:
            if hashing is not None:
                hashing.shutdown(cancel_futures=True)
            self._own.clear()  # the tensors hold their memory now; a reader kept open must not
        return CheckpointContents(
            trainable={n: fresh[id(i)] for n, i in self.trainable.items()},
            frozen={n: fresh[id(i)] for n, i in self.frozen.items()},
            optimizer_groups={g.name: OptimizerGroup(g.step, g.initial_learning_rate,
                                                     {p: {m: fresh[id(i)] for m, i in ms.items()}
                                                      for p, ms in g.states.items()})
                              for g in self.optimizer_groups.values()},
            properties=dict(self.properties), nominal=self.nominal)

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
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._data is not None:
            self._data.close()
            self._data = None
        for mm in (getattr(self, "_mm", None), self._data_mm):
            if isinstance(mm, mmap.mmap):
                try:
                    mm.close()
                except BufferError:  # tensors handed out still use the mapping; it goes away with them
                    pass

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- parsing ------------------------------------------------------------------------------------------------
    def _fail(self, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(message, self.path)

    def _parse(self) -> None:
        p = Verifier(self._mm, self._fail)
        if bytes(self._mm[4:8]) != FILE_IDENTIFIER:
            kind = _foreign_kind(bytes(self._mm[:16]))
            raise self._fail(f"not an ORT checkpoint (no 'ODTC' file identifier): {kind}" if kind else
                             f"not an ORT checkpoint: file identifier is {bytes(self._mm[4:8])!r}, expected 'ODTC'")
        root = p.table(p.u32(0, "root offset"), "Checkpoint")
        self.version = p.scalar(root, CheckpointSlot.VERSION, "i", 0)
        if self.version != VERSION:
            raise self._fail(f"checkpoint format version {self.version} is not supported (only {VERSION})")
        self.trainable, self.frozen = {}, {}
        self.nominal = self.has_external_data = False
        self._external: list[TensorInfo] = []
        ms_pos = p.offset(root, CheckpointSlot.MODULE_STATE)
        if ms_pos is not None:
            ms = p.table(ms_pos, "module_state")
            self.nominal = bool(p.scalar(ms, ModuleStateSlot.IS_NOMINAL_STATE, "?", False))
            self.has_external_data = bool(p.scalar(ms, ModuleStateSlot.HAS_EXTERNAL_DATA, "?", False))
            seen: set[str] = set()
            for slot, kind, target in ((ModuleStateSlot.REQUIRES_GRAD_PARAMS, "trainable", self.trainable),
                                       (ModuleStateSlot.FROZEN_PARAMS, "frozen", self.frozen)):
                for i, pos in enumerate(p.table_vector(ms, slot, f"module_state.{kind}")):
                    info = self._tensor(p, pos, kind, f"{kind} parameter #{i}")
                    if info.name in seen:
                        raise self._fail(f"parameter {info.name!r} appears more than once")
                    seen.add(info.name)
                    target[info.name] = info
        self.optimizer_groups = {}
        self._groups_field = p.offset(root, CheckpointSlot.OPTIMIZER_GROUPS) is not None
        for i, pos in enumerate(p.table_vector(root, CheckpointSlot.OPTIMIZER_GROUPS, "optimizer_groups")):
            group = self._group(p, pos, f"optimizer group #{i}")
            if group.name in self.optimizer_groups:
                raise self._fail(f"optimizer group {group.name!r} appears more than once")
            self.optimizer_groups[group.name] = group
        self.properties = self._properties(p, p.offset(root, CheckpointSlot.PROPERTY_BAG))
        self._check_external_data()
        self._read_checksums()

    def _tensor(self, p: Verifier, pos: int, kind: Kind, where: str) -> TensorInfo:
        t = p.table(pos, where)
        name = p.string_field(t, TensorSlot.NAME, where)
        if not name:
            raise self._fail(f"{where} has no name")
        where = f"{kind} tensor {name!r}" if kind != "momentum" else f"{where} {name!r}"
        doc_pos = p.offset(t, TensorSlot.DOC_STRING)
        doc = None if doc_pos is None else p.string(doc_pos, f"{where} doc_string")
        dims_pos = p.offset(t, TensorSlot.DIMS)
        if dims_pos is None:
            raise self._fail(f"{where} has no dims")
        count, start = p.vector(dims_pos, 8, f"{where} dims")
        dims = struct.unpack_from(f"<{count}q", self._mm, start)
        if any(d < 0 for d in dims):
            raise self._fail(f"{where} has a negative dimension in its shape {list(dims)}")
        code = p.scalar(t, TensorSlot.DATA_TYPE, "i", 0)
        try:
            dtype = DataType(code)
        except ValueError:
            raise self._fail(f"{where} has unknown data type {code}") from None
        numel = math.prod(dims)
        nbytes = numel * dtype.itemsize
        if len(dims) > _MAX_NDIM:
            raise self._fail(f"{where} has {len(dims)} dimensions; numpy and torch allow at most {_MAX_NDIM}")
        if math.prod(max(d, 1) for d in dims) * max(dtype.itemsize, 1) > _MAX_ARRAY_BYTES:  # even with a 0 dim
            raise self._fail(f"{where} has shape {list(dims)}, too large for numpy or torch to represent")
        raw_pos = p.offset(t, TensorSlot.RAW_DATA)
        strings_pos = p.offset(t, TensorSlot.STRING_DATA)
        ext = p.scalar(t, TensorSlot.EXTERNAL_DATA_OFFSET, "q", EXTERNAL_DATA_OFFSET_DEFAULT)
        shape = tuple(dims)
        if dtype is DataType.STRING:
            if strings_pos is None:
                raise self._fail(f"{where} is a STRING tensor without string_data")
            offsets = tuple(p.table_vector_at(strings_pos, f"{where} string_data"))
            if len(offsets) != numel:
                raise self._fail(f"{where} has shape {list(shape)} ({numel} elements) but {len(offsets)} strings")
            for i, off in enumerate(offsets):
                p.string(off, f"{where} string #{i}")
            return TensorInfo(name, kind, dtype, shape, 0, "strings", -1, doc, offsets)
        if ext != EXTERNAL_DATA_OFFSET_DEFAULT:
            if not self.has_external_data:
                raise self._fail(f"{where} points into external data, but the checkpoint says it has none")
            if ext < 0:
                raise self._fail(f"{where} has a negative external data offset {ext}")
            info = TensorInfo(name, kind, dtype, shape, nbytes, "external", ext, doc)
            self._external.append(info)
            return info
        if raw_pos is None:
            raise self._fail(f"{where} has neither raw data nor an external data offset")
        length, start = p.vector(raw_pos, 1, f"{where} raw_data")
        if self.nominal and length == 0 and not dims:
            return TensorInfo(name, kind, dtype, (), 0, "none", -1, doc)
        if length != nbytes:
            raise self._fail(f"{where} has shape {list(shape)} and type {dtype.name}, which need {nbytes:,} bytes, "
                             f"but its data holds {length:,} bytes")
        return TensorInfo(name, kind, dtype, shape, nbytes, "inline", start, doc)

    def _group(self, p: Verifier, pos: int, where: str) -> GroupInfo:
        g = p.table(pos, where)
        name = p.string_field(g, OptimizerGroupSlot.GROUP_NAME, where)
        where = f"optimizer group {name!r}"
        states: dict[str, dict[str, TensorInfo]] = {}
        for i, spos in enumerate(p.table_vector(g, OptimizerGroupSlot.OPTIMIZER_STATES, f"{where} states")):
            s = p.table(spos, f"{where} state #{i}")
            param = p.string_field(s, ParameterOptimizerStateSlot.PARAM_NAME, f"{where} state #{i}")
            if param in states:
                raise self._fail(f"{where} has state for parameter {param!r} more than once")
            momentums: dict[str, TensorInfo] = {}
            for j, mpos in enumerate(p.table_vector(s, ParameterOptimizerStateSlot.MOMENTUMS,
                                                    f"{where} state of {param!r}")):
                info = self._tensor(p, mpos, "momentum", f"{where} state of {param!r}:")
                if info.name in momentums:
                    raise self._fail(f"{where} state of {param!r} has {info.name!r} more than once")
                momentums[info.name] = info
            states[param] = momentums
        return GroupInfo(name, p.scalar(g, OptimizerGroupSlot.STEP, "q", 0),
                         p.scalar(g, OptimizerGroupSlot.INITIAL_LEARNING_RATE, "f", 0.0), states)

    def _properties(self, p: Verifier, pos: int | None) -> dict[str, PropertyValue]:
        out: dict[str, PropertyValue] = {}
        if pos is None:
            return out
        bag = p.table(pos, "property_bag")
        for slot, kind in ((PropertyBagSlot.INTS, "q"), (PropertyBagSlot.FLOATS, "f"), (PropertyBagSlot.STRINGS, "s")):
            for i, ppos in enumerate(p.table_vector(bag, slot, f"property_bag.{slot.name.lower()}")):
                where = f"property #{i} of {slot.name.lower()}"
                t = p.table(ppos, where)
                name = p.string_field(t, PropertySlot.NAME, where)
                if kind == "s":
                    value: PropertyValue = p.string_field(t, PropertySlot.VALUE, f"property {name!r}")
                else:
                    value = p.scalar(t, PropertySlot.VALUE, kind, 0.0 if kind == "f" else 0)
                out[name] = value  # as in ORT, a later duplicate replaces an earlier one
        return out

    def _check_external_data(self) -> None:
        if not self.has_external_data:
            return
        try:
            st = os.fstat(self._data.fileno()) if self._data is not None else os.stat(self.data_path)
        except FileNotFoundError:
            raise self._fail(f"its external data file {self.data_path} is missing") from None
        except OSError as e:  # a symlink loop, a path through a file
            raise self._fail(f"its external data file {self.data_path} cannot be opened ({e.strerror or e})") from None
        if not stat.S_ISREG(st.st_mode):
            raise self._fail(f"its external data file {self.data_path} is not a regular file")
        self._check_confined(None if self._data is None else self._data.fileno())
        size = st.st_size
        for info in self._external:
            if info.offset + info.nbytes > size:
                raise self._fail(f"{info.kind} tensor {info.name!r} needs bytes {info.offset:,}..."
                                 f"{info.offset + info.nbytes:,} of {self.data_path}, which has only {size:,}")

    def _read_checksums(self) -> None:
        text = self.properties.pop(_checksums.PROPERTY, None)  # ours, not the user's: never handed back as one
        self._keys: dict[int, str] = {id(i): _checksums.param_key(n)
                                      for n, i in (*self.trainable.items(), *self.frozen.items())}
        for g in self.optimizer_groups.values():
            for param, momentums in g.states.items():
                self._keys.update((id(i), _checksums.state_key(g.name, param, m)) for m, i in momentums.items())
        self.checksums = None
        if text is None:
            return
        try:
            if not self._groups_field:  # ORT's saves and ours always write it, if empty
                raise ValueError("the file lacks the optimizer_groups field that was there when it was saved")
            self.checksums = _checksums.parse(text, {g.name: g.step for g in self.optimizer_groups.values()})
        except (ValueError, RecursionError) as e:
            raise self._fail(f"its tensor checksums (property {_checksums.PROPERTY!r}) are damaged: {e}") from None
        if not self.checksums.usable:
            return
        present = set()
        for info in self.tensors():
            key = self._keys[id(info)]
            present.add(key)
            if info.storage in ("inline", "external") and key not in self.checksums.digests:
                raise self._fail(f"{info.kind} tensor {info.name!r} has no recorded checksum although the file "
                                 "records them: its name or the checksum record is damaged")
        missing = sorted(self.checksums.digests.keys() - present)
        if missing:
            raise self._fail(f"{missing[0].split(':', 1)[1]!r} was saved but is not in the file ({len(missing)} "
                             "tensor(s) missing): its structure or the checksum record is damaged")

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
                 os.path.dirname(_fd_path(self._fd) or os.path.realpath(self.path))}
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

    def _digest(self, info: TensorInfo) -> int:
        """The checksum of the tensor's bytes: from its own memory while :meth:`load` runs, else read from the file
        a chunk at a time into one buffer (never mapped: a mapped page read stays in this process's memory)."""
        h = _checksums.hasher(int(info.dtype), info.shape)
        own = self._own.get(id(info))
        if own is not None:
            h.update(own)
            return h.intdigest()
        fd, path = (self._fd, self.path) if info.storage == "inline" else (self._data_fd(), self.data_path)
        buf = memoryview(bytearray(min(info.nbytes, _VERIFY_CHUNK)))
        pos, stop = info.offset, info.offset + info.nbytes
        while pos < stop:
            n = _pread_into(fd, buf[:min(len(buf), stop - pos)], pos, portable_io())
            if n == 0:
                raise CorruptCheckpointError(f"file ended early at byte {pos:,} (it shrank while being read)", path)
            h.update(buf[:n])
            pos += n
        return h.intdigest()

    def _compare(self, info: TensorInfo, found: int) -> None:
        if found != self.checksums.digests[self._keys[id(info)]]:  # type: ignore[union-attr]
            where = f" (in {self.data_path})" if info.storage == "external" else ""
            what = {"momentum": "optimizer state", "trainable": "parameter", "frozen": "parameter or buffer"}
            name = self._keys[id(info)].split(":", 1)[1]
            raise self._fail(f"{what[info.kind]} {name!r}{where} is damaged: its bytes (or type or shape) do not "
                             "match the checksum recorded when it was saved")

    def _raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes: its own memory while :meth:`load` runs, else a view of the mapped file."""
        own = self._own.get(id(info))
        if own is not None:
            return own
        return np.frombuffer(self._map_for(info), dtype=np.uint8, count=info.nbytes, offset=info.offset)

    # -- data access --------------------------------------------------------------------------------------------
    def _checked_dtype(self, info: TensorInfo) -> DataType:
        if info.storage == "none":
            raise CorruptCheckpointError(f"{info.kind} tensor {info.name!r} has no data: this is a nominal "
                                         "checkpoint (names and types only)", self.path)
        if info.storage == "strings":
            raise CorruptCheckpointError(f"{info.kind} tensor {info.name!r} holds strings; use numpy()", self.path)
        return info.dtype

    def _map_for(self, info: TensorInfo) -> Any:
        if info.storage == "inline":
            return self._mm
        with self._mapping:
            if self._data_mm is None:
                needed = max(i.offset + i.nbytes for i in self._external)  # a tail beyond it is never read
                with self._data if self._data is not None else self._open_data() as f:
                    if os.fstat(f.fileno()).st_size < needed:
                        raise self._fail(f"its external data file {self.data_path} shrank while it was open")
                    self._data_mm = _map(f.fileno(), needed, self.path)
                self._data = None
        return self._data_mm

    def _data_fd(self) -> int:
        """The ``.data`` file's descriptor: the one opened with the checkpoint, or, once mapped, opened again."""
        with self._mapping:  # verify() asks from two threads
            if self._data is None:
                self._data = self._open_data()
            return self._data.fileno()

    def _strings(self, info: TensorInfo) -> list[str]:
        p = Verifier(self._mm, self._fail)
        return [p.string(off, f"{info.name} string") for off in info.string_offsets]


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


def _has_torch() -> bool:
    """Whether torch can be imported: tensors are torch's where it can, numpy's where it cannot."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _fd_path(fd: int) -> str | None:
    """The path the open file ``fd`` has now (Linux's ``/proc``), or None where the system does not say."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return path.removesuffix(" (deleted)") if os.path.isabs(path) else None


def _foreign_kind(head: bytes) -> str | None:
    """What a file that is not an ODTC checkpoint is, in words, from its first bytes (None: unknown)."""
    if head.startswith(b"PK\x03\x04"):
        return "it is a zip archive, as torch.save writes (a torch checkpoint: load it with torch or Lightning)"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "it is a Python pickle (a torch checkpoint in torch's legacy format)"
    if head[:1] == b"\x08":  # ModelProto field 1 (ir_version, a varint), then another ModelProto field's tag
        end = next((i for i in range(1, min(len(head), 11)) if head[i] < 0x80), None)
        if end is not None and head[end + 1:end + 2] in (b"\x12", b"\x1a", b"\x22", b"\x28", b"\x32", b"\x3a",
                                                         b"\x42", b"\x72"):
            return "it is an ONNX model (an inference or training graph), not a checkpoint of its state"
    if len(head) > 8 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 100 << 20:
        return "it looks like a safetensors file"
    return None


_VERIFY_CHUNK = 1 << 20  # what verification reads at a time, into one buffer per thread
_PARALLEL_VERIFY_BYTES = 256 << 20  # below this, one thread verifies: starting another costs more than it saves
_MAX_NDIM = 64  # numpy's limit (torch's is the same or higher)
_MAX_ARRAY_BYTES = 2**63 - 1  # numpy and torch strides are int64: itemsize x the nonzero dims must fit
