"""Writes a :class:`CheckpointContents` as an ODTC file, byte-identical to ORT 1.19.2's ``CheckpointState.save_checkpoint``.

Saving has two steps, as in ``torch.distributed.checkpoint``: *planning* lays out every byte of the file with
:class:`LayoutBuilder` (names, dims and offsets only), then *streaming* copies tensor bytes from each tensor's own
memory to the file (with write-behind: see ``diskio``). A tensor that is not contiguous, not on the CPU, or to be
stored as another type (:class:`StoredAs`) is converted chunk by chunk into one reused buffer of ``_CHUNK_BYTES``:
that buffer is the save's peak extra memory; the file is never assembled in memory. Each tensor's checksum is
computed as it streams (see ``checksums``) and written into the planned record before the commit, which is atomic
(see ``atomic``).

Build order follows ORT's ``FromCheckpointState``: parameters sorted by name (trainable, then frozen), optimizer
groups, parameters and momentums sorted, properties sorted across the bag, then the root table.
"""

from __future__ import annotations

import errno
import math
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, TypeGuard

import numpy as np

if TYPE_CHECKING:  # the writer streams torch tensors without importing torch at import
    import torch

from ..errors import CheckpointSaveError
from ._atomic import SaveFiles
from . import _checksums
from ._contents import CheckpointContents, Deferred, OptimizerGroup, PropertyValue, StoredAs, Tensor
from ._deprecated import warn_once
from ._diskio import BEHIND_BYTES, WriteBehind
from ._dtypes import DataType, from_numpy, from_torch
from ._flatbuffers import Blob, LayoutBuilder, LayoutTooLarge, Piece
from ._platform import portable_io
from ._store import StorageOptions, Store, store_for
from ._shared_data import NotShared, SavedData, SharedFrozen, SharedTooLarge
from ._schema import (EXTERNAL_DATA_OFFSET_DEFAULT, FILE_IDENTIFIER, VERSION, CheckpointSlot, ModuleStateSlot, OptimizerGroupSlot, ParameterOptimizerStateSlot, PropertyBagSlot, PropertySlot, TensorSlot)

ExternalData = Literal["auto", "never", "params", "all"]

_IOV_MAX = 1024  # pieces per writev (POSIX's minimum IOV_MAX is 16; Linux, macOS and the BSDs allow 1024)
_CHUNK_BYTES = 16 << 20  # bound on one converted chunk (a non-contiguous, off-CPU or StoredAs tensor)
_INT64 = (-(2**63), 2**63 - 1)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def save_checkpoint(checkpoint: CheckpointContents, path: str | os.PathLike[str], *, store: Store | None = None,
                    external_data: ExternalData = "auto", checksums: bool = True,
                    shared: SharedFrozen | None = None,
                    storage_options: StorageOptions | None = None,
                    when_read: Callable[[], None] | None = None) -> SavedData | None:
    """Write ``checkpoint`` to ``path`` atomically (``path + ".data"`` too when it uses external data) through
    ``store`` (``_store``; by default the store of ``path`` without options: the local disk for a path, fsspec's
    defaults for a URL such as ``s3://bucket/run/last.ckpt``; for credentials pass
    ``store=store_for(url, storage_options)``): plan every byte, stream the tensors into the store's new files, commit.
    ``storage_options`` is deprecated (a ``FutureWarning``; give ``store``).

    ``external_data``: ``"auto"`` keeps everything in one file unless it would pass the FlatBuffers 2 GiB limit, then
    moves parameters (and, if still needed, optimizer momentums) to ``<path>.data``; ``"never"`` refuses instead;
    ``"params"`` always moves parameters out, as ORT does for a state it loaded with external data; ``"all"`` moves
    momentums out too, which ORT itself never does.

    ``checksums`` (the default) records a checksum of every tensor's bytes, computed as they are written, in the
    string property ``lightning_ort_ckpt.checksums`` (see ``checksums``); loads verify them. ``False`` writes exactly
    what ORT would write for the same state.

    ``shared`` (with ``external_data="auto"``): the frozen tensors it names go to a ``.data`` file that later saves
    can share, or that is a hard link to an earlier save's (see ``shared``); everything else stays inline. What was
    put there is returned (None without ``shared``). The writer carries the plan out as given: where it cannot (no
    link here, a linked tensor's bytes changed, or the rest inline would pass 2 GiB: :class:`shared.SharedTooLarge`)
    it raises :class:`shared.NotShared` and commits nothing; what to save instead is the caller's choice.

    ``when_read`` is called once every tensor's bytes have been read (written and hashed), before the commit, so
    that a caller writing from tensors it must not change meanwhile can let them change again; an exception it
    raises commits nothing.
    """
    path = os.fspath(path)
    if storage_options is not None:
        if store is not None:
            raise TypeError("save_checkpoint takes a store or storage_options, not both")
        warn_once("lightning_ort_ckpt.format.save_checkpoint(storage_options=...)",
                  "pass store=lightning_ort_ckpt.format.store_for(path, storage_options)", since="0.4",
                  removed_in="0.5")
    if store is None:
        store = store_for(path, storage_options)
    if shared is not None and (external_data != "auto" or not store.links):
        raise NotShared(path, [])
    return _save(checkpoint, path, store, external_data, checksums, shared, when_read)


def _save(checkpoint: CheckpointContents, path: str, store: Store, external_data: ExternalData, checksums: bool,
          shared: SharedFrozen | None, when_read: Callable[[], None] | None) -> SavedData | None:
    tensors = _Tensors(path)
    plan = _plan_for_mode(checkpoint, tensors, external_data, path, checksums, shared)
    link = shared.link if shared is not None and shared.link_from is not None else None
    # a store that cannot write into a file it streamed (an upload) gets the checksum record computed first
    record = plan.checksums.fill(_digests(tensors)) if plan.checksums is not None and not store.rewritable else None
    try:
        with store.writing(path, with_data=plan.data_size is not None, link_data=link,
                           required_bytes=plan.size + (plan.data_size or 0)) as files:
            if link is not None and not files.linked:  # no link here (another file system): nothing written yet
                raise NotShared(path, [])
            with _Hashing(tensors, plan.checksums is not None and record is None) as hashing:
                for key in _to_verify(shared, plan, tensors) if plan.checksums is not None else ():
                    hashing.feed(key)  # on the helper thread, while the main file is written
                written = _stream(files.main, plan.pieces, tensors, hashing, record)
                if files.data is not None:
                    _stream_external(files.data, plan.external, tensors, hashing)
            digests = hashing.digests() if plan.checksums is not None and record is None else {}
            saved = _check_shared(shared, plan, tensors, files, digests, path) if shared is not None else None
            if plan.checksums is not None and record is None:
                _write_at(files.main, hashing.record_offset, plan.checksums.fill(digests))
            if when_read is not None:
                when_read()
    except CheckpointSaveError:
        raise
    except OSError as e:
        raise CheckpointSaveError(f"save failed ({e.strerror or e}); the previous checkpoint at this path, if any, "
                                  "is unchanged", path) from e
    if written != plan.size:  # pragma: no cover - planner and streamer disagree: a bug, never silently written
        raise CheckpointSaveError(f"internal error: planned {plan.size} bytes, wrote {written}", path)
    return saved


def _digests(tensors: _Tensors) -> dict[str, int]:
    """Every tensor's checksum, read before streaming, for a store whose new files cannot be written back into."""
    found = {}
    for key, entry in enumerate(tensors.entries):
        if entry.checksum_key is not None:
            h = _checksums.hasher(int(entry.dtype), tuple(entry.dims))
            for chunk, _ in tensors.chunks(key):
                h.update(chunk)
            found[entry.checksum_key] = h.intdigest()
    return found


def _check_shared(shared: SharedFrozen, plan: _Plan, tensors: _Tensors, files: SaveFiles,
                  digests: dict[str, int], path: str) -> SavedData:
    """What the save put in ``.data`` (``SharedFrozen.carried_out``: the linked tensors confirmed, the file made
    read-only), from what this save planned and hashed."""
    hashed = set(_to_verify(shared, plan, tensors))
    linked = [(tensors.entries[k].name, tensors.entries[k].checksum_key, k in hashed) for k in plan.linked]
    layout = {e.name: (int(e.dtype), tuple(e.dims), e.nbytes) for e in tensors.entries
              if e.name in plan.offsets and e.checksum_key == _checksums.param_key(e.name)}
    data = files.data.fileno() if files.data is not None else None
    return shared.carried_out(linked, digests, files.linked, data, plan.offsets, layout, path)


def _to_verify(shared: SharedFrozen | None, plan: _Plan, tensors: _Tensors) -> list[int]:
    """The linked tensors to hash again (``SharedFrozen.rehash``)."""
    if shared is None:
        return []
    return [k for k in plan.linked if shared.rehash(tensors.entries[k].name, tensors.entries[k].checksum_key)]


# -- tensors ----------------------------------------------------------------------------------------------------
@dataclass
class _Entry:
    """What the planner needs to know about one tensor, and where its bytes come from."""

    name: str
    dtype: DataType
    dims: tuple[int, ...]
    nbytes: int
    source: Any
    strings: list[str] | None = None
    checksum_key: str | None = None


class _Tensors:
    """Describes tensors for the planner and hands them out by blob key to the streamer."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: list[_Entry] = []
        self.scratch: np.ndarray | None = None

    def add(self, name: str, tensor: Tensor, what: str, checksum_key: str) -> int:
        if not isinstance(name, str) or not name:
            raise CheckpointSaveError(f"every {what} needs a non-empty string name, got {name!r}", self.path)
        try:
            entry = _describe(name, tensor)
        except (TypeError, ValueError) as e:
            raise CheckpointSaveError(f"{what} {name!r}: {e}", self.path) from None
        if entry.strings is None:
            entry.checksum_key = checksum_key
        self.entries.append(entry)
        return len(self.entries) - 1

    def chunks(self, key: int) -> Iterator[tuple[memoryview, bool]]:
        return _byte_chunks(self.entries[key].source, self._scratch)

    def _scratch(self) -> np.ndarray:
        """The save's one buffer for converted chunks (allocated on first use, then reused)."""
        if self.scratch is None:
            self.scratch = np.empty(_CHUNK_BYTES, dtype=np.uint8)
        return self.scratch


def _describe(name: str, tensor: Tensor) -> _Entry:
    stored = tensor.dtype if isinstance(tensor, StoredAs) else None
    source = tensor.tensor if isinstance(tensor, StoredAs) else tensor
    if isinstance(source, Deferred):
        dtype = stored or source.dtype
        return _Entry(name, dtype, tuple(source.shape), math.prod(source.shape) * dtype.itemsize, tensor)
    if _is_torch(source):
        import torch

        if source.layout != torch.strided or source.is_quantized:
            raise TypeError(f"only dense, unquantized tensors can be saved (this one is {source.layout})")
        dtype = stored or from_torch(source.dtype)
        return _Entry(name, dtype, tuple(source.shape), source.numel() * dtype.itemsize, tensor)
    array = np.asarray(source)
    dtype = stored or from_numpy(array.dtype)
    if dtype is DataType.STRING:
        strings = [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in array.reshape(-1).tolist()]
        return _Entry(name, dtype, array.shape, 0, array, strings)
    return _Entry(name, dtype, array.shape, array.size * dtype.itemsize,
                  array if stored is None else StoredAs(array, stored))


def _is_torch(obj: Any) -> TypeGuard[torch.Tensor]:
    """Whether ``obj`` is a torch tensor, asked without importing torch (this layer never imports it itself)."""
    return type(obj).__module__.startswith("torch")


def _byte_chunks(tensor: Any, scratch: Callable[[], np.ndarray]) -> Iterator[tuple[memoryview, bool]]:
    """The tensor's bytes in C order as stored (little-endian, converted to a ``StoredAs`` type), each with whether
    it lies in ``scratch`` memory: straight from the tensor's memory when it is a contiguous CPU tensor of that
    type (not scratch), else converted chunk by chunk into the one ``_CHUNK_BYTES`` scratch buffer of the save,
    which the next chunk overwrites (so the caller writes each before it asks for the next). A :class:`Deferred`
    tensor is loaded here and its chunks flagged as scratch, so that each is written before the next and nothing
    keeps the loaded tensor once it is streamed."""
    stored = tensor.dtype if isinstance(tensor, StoredAs) else None
    source = tensor.tensor if isinstance(tensor, StoredAs) else tensor
    if isinstance(source, Deferred):
        loaded = source.load()
        for chunk, _ in _byte_chunks(loaded if stored is None else StoredAs(loaded, stored), scratch):
            yield chunk, True
        return
    if _is_torch(source):
        yield from _torch_chunks(source, stored, scratch)
        return
    array = np.asarray(source)
    out = stored.to_numpy() if stored is not None else array.dtype.newbyteorder("<")
    if array.size == 0:
        return
    if array.flags.c_contiguous and array.dtype == out:
        yield array.reshape(-1).view(np.uint8).data, False
        return
    buf = scratch()
    for part in _parts(array, out.itemsize):
        dst = buf[:part.size * out.itemsize]
        np.copyto(dst.view(out).reshape(part.shape), part)
        yield dst.data, True


def _torch_chunks(tensor: Any, stored: DataType | None,
                  scratch: Callable[[], np.ndarray]) -> Iterator[tuple[memoryview, bool]]:
    import torch

    t = tensor.detach()
    if t.numel() == 0:
        return
    out = stored.to_torch() if stored is not None else t.dtype
    if t.device.type == "cpu" and t.is_contiguous() and t.dtype == out and not (t.is_conj() or t.is_neg()):
        yield t.reshape(-1).view(torch.uint8).numpy().data, False
        return
    buf = torch.from_numpy(scratch())
    for part in _parts(t, out.itemsize):
        dst = buf[:part.numel() * out.itemsize]
        dst.view(out).view(part.shape).copy_(part)  # converts the type, gathers strides, resolves conj/neg views
        yield dst.numpy().data, True


def _parts(t: Any, itemsize: int) -> Iterator[Any]:
    """Pieces of a tensor or array that cover it in C order, each at most ``_CHUNK_BYTES`` once converted to
    ``itemsize`` bytes per element: runs of rows of the first dimension, or, for a row larger than that, the
    pieces of each row in turn (so a ``(1, n)`` view or a huge row is never copied whole)."""
    if t.ndim == 0:
        yield t.reshape(1)
        return
    row_bytes = math.prod(t.shape[1:]) * itemsize
    if row_bytes > _CHUNK_BYTES and t.ndim > 1:
        for i in range(t.shape[0]):
            yield from _parts(t[i], itemsize)
        return
    rows = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    for start in range(0, t.shape[0], rows):
        yield t[start:start + rows]


# -- planning ---------------------------------------------------------------------------------------------------
@dataclass
class _Plan:
    pieces: list[Piece]
    size: int
    external: list[tuple[int, int]]  # (padding before the blob, blob key), in .data file order
    data_size: int | None
    checksums: _checksums.Template | None
    linked: list[int]  # blob keys of the tensors in a linked .data (not streamed)
    offsets: dict[str, int]  # shared frozen tensor -> its offset in .data


def _plan_for_mode(ck: CheckpointContents, tensors: _Tensors, mode: ExternalData, path: str, checksums: bool = True,
                   shared: SharedFrozen | None = None) -> _Plan:
    choices = {"never": [(False, False)], "params": [(True, False)], "all": [(True, True)],
               "auto": [(False, False), (True, False), (True, True)]}
    if mode not in choices:
        raise CheckpointSaveError(f"external_data must be one of {sorted(choices)}, not {mode!r}", path)
    if shared is not None:
        tensors.entries.clear()
        try:
            return _Planner(tensors, False, False, checksums, shared).plan(ck)
        except LayoutTooLarge:
            raise SharedTooLarge(path) from None
    for params_out, momentums_out in choices[mode]:
        tensors.entries.clear()
        try:
            return _Planner(tensors, params_out, momentums_out, checksums).plan(ck)
        except LayoutTooLarge:  # planning stops as soon as the buffer passes the limit: try the next layout
            continue
    hint = "" if mode == "auto" else '; use external_data="auto"'
    raise CheckpointSaveError(f"the checkpoint file would pass the 2 GiB FlatBuffers limit with "
                              f"external_data={mode!r}{hint}", path)


class _Planner:
    def __init__(self, tensors: _Tensors, params_out: bool, momentums_out: bool, checksums: bool,
                 shared: SharedFrozen | None = None) -> None:
        self.b = LayoutBuilder()
        self.shared = shared
        self.linked: list[int] = []
        self.offsets: dict[str, int] = {}
        self.checksums = checksums
        self.template: _checksums.Template | None = None
        self.tensors = tensors
        self.params_out = params_out
        self.momentums_out = momentums_out
        self.external: list[tuple[int, int]] = []
        self.data_pos = 0
        self.path = tensors.path

    def plan(self, ck: CheckpointContents) -> _Plan:
        b = self.b
        overlap = sorted(ck.trainable.keys() & ck.frozen.keys())
        if overlap:
            raise CheckpointSaveError(f"parameter {overlap[0]!r} is both trainable and frozen", self.path)
        has_params = bool(ck.trainable or ck.frozen)
        self.params_out &= has_params
        self.momentums_out &= has_params  # the external-data flag lives in the module state
        module_state = self._module_state(ck) if has_params else None
        groups = [self._group(name, ck.optimizer_groups[name]) for name in _sorted(ck.optimizer_groups)]
        properties: dict[str, PropertyValue | _checksums.Template] = {
            k: v for k, v in ck.properties.items() if k != _checksums.PROPERTY}  # a record read from a file is stale
        if self.checksums and not ck.nominal:
            keyed = [e.checksum_key for e in self.tensors.entries if e.checksum_key is not None]
            self.template = _checksums.Template(keyed, {g: ck.optimizer_groups[g].step for g in ck.optimizer_groups})
            properties[_checksums.PROPERTY] = self.template
        bag = self._property_bag(properties) if properties else None
        groups_vec = b.offset_vector(groups)
        b.start_table()
        b.add_scalar(CheckpointSlot.VERSION, "i", VERSION, 0)
        b.add_offset(CheckpointSlot.MODULE_STATE, module_state)
        b.add_offset(CheckpointSlot.OPTIMIZER_GROUPS, groups_vec)
        b.add_offset(CheckpointSlot.PROPERTY_BAG, bag)
        pieces = b.finish(b.end_table(), FILE_IDENTIFIER)
        data_size = self.data_pos if self.params_out or self.momentums_out or self.shared is not None else None
        return _Plan(pieces, b.size, self.external, data_size, self.template, self.linked, self.offsets)

    def _tensor(self, name: str, tensor: Tensor, what: str, external: bool, checksum_key: str,
                nominal: bool = False) -> int:
        b = self.b
        key = self.tensors.add(name, tensor, what, checksum_key)
        e = self.tensors.entries[key]
        name_off = b.string(name)
        dims = () if nominal else e.dims
        dims_off = b.scalar_vector(struct.pack(f"<{len(dims)}q", *dims), len(dims), 8)
        if e.strings is not None:
            data_off = b.offset_vector([b.string(s) for s in e.strings])
        elif nominal or not external:
            data_off = b.blob_vector(Blob(key, 0 if nominal else e.nbytes))
        b.start_table()
        b.add_offset(TensorSlot.NAME, name_off)
        b.add_offset(TensorSlot.DIMS, dims_off)
        b.add_scalar(TensorSlot.DATA_TYPE, "i", int(e.dtype), 0)
        if e.strings is not None:
            b.add_offset(TensorSlot.STRING_DATA, data_off)
        elif external and not nominal:
            offset = self.shared.names.get(name, -1) if self.shared is not None else -1
            if offset >= 0:  # in a linked .data already
                self.linked.append(key)
            else:
                pad = -self.data_pos % e.dtype.external_alignment
                self.external.append((pad, key))
                offset = self.data_pos + pad
                self.data_pos = offset + e.nbytes
            if self.shared is not None:
                self.offsets[name] = offset
            b.add_scalar(TensorSlot.EXTERNAL_DATA_OFFSET, "q", offset, EXTERNAL_DATA_OFFSET_DEFAULT)
        else:
            b.add_offset(TensorSlot.RAW_DATA, data_off)
        return b.end_table()

    def _module_state(self, ck: CheckpointContents) -> int:
        b = self.b
        trainable = [self._tensor(n, ck.trainable[n], "trainable parameter", self.params_out,
                                  _checksums.param_key(n), ck.nominal) for n in _sorted(ck.trainable)]
        shared = self.shared.names if self.shared is not None else {}
        frozen = [self._tensor(n, ck.frozen[n], "frozen parameter", self.params_out or n in shared,
                               _checksums.param_key(n), ck.nominal) for n in _sorted(ck.frozen)]
        trainable_vec, frozen_vec = b.offset_vector(trainable), b.offset_vector(frozen)
        b.start_table()
        b.add_offset(ModuleStateSlot.REQUIRES_GRAD_PARAMS, trainable_vec)
        b.add_offset(ModuleStateSlot.FROZEN_PARAMS, frozen_vec)
        b.add_scalar(ModuleStateSlot.IS_NOMINAL_STATE, "?", ck.nominal, False)
        b.add_scalar(ModuleStateSlot.HAS_EXTERNAL_DATA, "?",
                     self.params_out or self.momentums_out or self.shared is not None, False)
        return b.end_table()

    def _group(self, group_name: str, group: OptimizerGroup) -> int:
        b = self.b
        states = []
        for param in _sorted(group.states):
            momentums = group.states[param]
            tables = [self._tensor(m, momentums[m], f"optimizer state {group_name}/{param}", self.momentums_out,
                                   _checksums.state_key(group_name, param, m)) for m in _sorted(momentums)]
            name_off = b.string(self._name(param, "parameter"))
            vec = b.offset_vector(tables)
            b.start_table()
            b.add_offset(ParameterOptimizerStateSlot.PARAM_NAME, name_off)
            b.add_offset(ParameterOptimizerStateSlot.MOMENTUMS, vec)
            states.append(b.end_table())
        name_off = b.string(self._name(group_name, "optimizer group"))
        vec = b.offset_vector(states)
        b.start_table()
        b.add_offset(OptimizerGroupSlot.GROUP_NAME, name_off)
        b.add_scalar(OptimizerGroupSlot.INITIAL_LEARNING_RATE, "f",
                     self._float32(group.initial_learning_rate, f"initial_learning_rate of {group_name}"), 0.0)
        b.add_scalar(OptimizerGroupSlot.STEP, "q", self._int64(group.step, f"step of {group_name}"), 0)
        b.add_offset(OptimizerGroupSlot.OPTIMIZER_STATES, vec)
        return b.end_table()

    def _property_bag(self, properties: dict[str, PropertyValue | _checksums.Template]) -> int:
        b = self.b
        by_type: dict[type, list[int]] = {int: [], float: [], str: []}
        for name in _sorted(properties):
            value = properties[name]
            name_off = b.string(self._name(name, "property"))
            value_off: int | None
            kind: type
            if isinstance(value, _checksums.Template):  # filled in once every tensor is written
                value_off = b.string_blob(Blob(_RECORD, len(value.text)))
                value = value.text
            else:
                value_off = b.string(value) if isinstance(value, str) else None
            b.start_table()
            b.add_offset(PropertySlot.NAME, name_off)
            if isinstance(value, (bool, int, np.integer)):
                kind = int
                b.add_scalar(PropertySlot.VALUE, "q", self._int64(int(value), f"property {name!r}"), 0)
            elif isinstance(value, (float, np.floating)):
                kind = float
                b.add_scalar(PropertySlot.VALUE, "f", self._float32(float(value), f"property {name!r}"), 0.0)
            elif isinstance(value, str):
                kind = str
                b.add_offset(PropertySlot.VALUE, value_off)
            else:
                raise CheckpointSaveError(f"property {name!r} must be an int, float or str, not "
                                          f"{type(value).__name__}", self.path)
            by_type[kind].append(b.end_table())
        ints, floats, strings = (b.offset_vector(by_type[k]) for k in (int, float, str))
        b.start_table()
        b.add_offset(PropertyBagSlot.INTS, ints)
        b.add_offset(PropertyBagSlot.FLOATS, floats)
        b.add_offset(PropertyBagSlot.STRINGS, strings)
        return b.end_table()

    def _name(self, name: str, what: str) -> str:
        if not isinstance(name, str):
            raise CheckpointSaveError(f"{what} names must be strings, got {name!r}", self.path)
        return name

    def _int64(self, value: int, what: str) -> int:
        if not _INT64[0] <= value <= _INT64[1]:
            raise CheckpointSaveError(f"{what} = {value} does not fit in int64", self.path)
        return value

    def _float32(self, value: float, what: str) -> float:
        if math.isfinite(value) and abs(value) > _FLOAT32_MAX:
            raise CheckpointSaveError(f"{what} = {value!r} overflows float32, the format's float type", self.path)
        return struct.unpack("<f", struct.pack("<f", value))[0]


def _sorted(names: Any) -> list[str]:
    """ORT sorts with std::sort on std::string: UTF-8 byte order."""
    return sorted(names, key=lambda n: n.encode("utf-8") if isinstance(n, str) else b"")


# -- streaming --------------------------------------------------------------------------------------------------
_RECORD = -1  # the blob key of the checksum record: written as a placeholder, filled in after the tensors


def _stream(out: BinaryIO, pieces: list[Piece], tensors: _Tensors, hashing: _Hashing,
            record: bytes | None = None) -> int:
    """Write the main file in order; the checksum record is a placeholder, filled in afterwards, unless the caller
    computed it ahead (``record``: a file that cannot seek back, an object being uploaded)."""
    writer = _Writer(out, hashing)
    for piece in pieces:
        if isinstance(piece, Blob) and piece.key == _RECORD:
            hashing.record_offset = writer.total + writer.pending_bytes
            writer.small(bytes(piece.nbytes) if record is None else record)
        elif isinstance(piece, Blob):
            writer.blob(tensors, piece.key)
        else:
            writer.small(piece)
    return writer.close()


def _stream_external(out: BinaryIO, external: list[tuple[int, int]], tensors: _Tensors, hashing: _Hashing) -> int:
    writer = _Writer(out, hashing)
    for pad, key in external:
        writer.small(bytes(pad))
        writer.blob(tensors, key)
    return writer.close()


def _fileno(out: BinaryIO) -> int | None:
    try:
        return out.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None


def _write_at(out: BinaryIO, offset: int, data: bytes) -> None:
    """Overwrite ``data`` at ``offset`` of the file being saved (before its fsync), then go back to the position
    the streaming reached (not the file's end: a file written over may be longer until its commit truncates it)."""
    end = out.tell()
    out.seek(offset)
    view = memoryview(data)
    while view:
        view = view[out.write(view):]
    out.seek(end)


class _Hashing:
    """Checksums of the tensors as they stream. In a save on the main thread (one that training waits for), large
    chunks are hashed on a helper thread while the main thread writes them (the hash releases the GIL), so hashing
    hides under the writes; small ones are hashed in place. A save already on a thread of its own (``async_save``'s
    writer, a DCP executor) hashes everything in place: training is not waiting for it, and a helper would take a core
    from training instead (the fast tier saving every step on 2 cores: docs/performance.md). A plain thread, not a
    ``concurrent.futures`` pool: saves queued by ``async_save`` may run during interpreter exit, when pools refuse
    work (where even a thread cannot start, everything is hashed in place)."""

    _THREAD_MIN = 1 << 20

    def __init__(self, tensors: _Tensors, enabled: bool) -> None:
        self.tensors = tensors
        self.enabled = enabled
        self.helper = threading.current_thread() is threading.main_thread()  # see the class's doc
        self.hashers: dict[str, Any] = {}
        self.record_offset = -1
        self._queue: queue.Queue[tuple[Any, memoryview] | None] | None = None
        self._thread: threading.Thread | None = None
        self._queued: set[int] = set()  # hashers with updates on the thread: all their later ones go there too

    def __enter__(self) -> _Hashing:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._queue.put(None)  # type: ignore[union-attr]
            self._thread.join()

    def start(self, key: int) -> Any:
        entry = self.tensors.entries[key]
        if not self.enabled or entry.checksum_key is None:
            return None
        h = self.hashers[entry.checksum_key] = _checksums.hasher(int(entry.dtype), tuple(entry.dims))
        return h

    def update(self, h: Any, data: memoryview) -> None:
        if h is None:
            return
        if not self.helper or (data.nbytes < self._THREAD_MIN and id(h) not in self._queued) \
                or not self._start_thread():
            h.update(data)
            return
        self._queued.add(id(h))
        self._queue.put((h, data))  # type: ignore[union-attr]  # one thread: a tensor's updates stay in order

    def feed(self, key: int) -> None:
        """Hash tensor ``key`` without writing it (a tensor of a linked ``.data``: confirms it is unchanged)."""
        h = self.start(key)
        for chunk, scratch in self.tensors.chunks(key):
            self.update(h, chunk)
            if scratch:  # the next chunk overwrites this one
                self.drain()

    def drain(self) -> None:
        """Wait until every update given to the helper thread is hashed (before the memory it reads is reused)."""
        if self._queue is not None:
            self._queue.join()

    def digests(self) -> dict[str, int]:
        self.drain()
        return {e.checksum_key: (self.hashers.get(e.checksum_key)  # a tensor without bytes streams no blob
                                 or _checksums.hasher(int(e.dtype), tuple(e.dims))).intdigest()
                for e in self.tensors.entries if e.checksum_key is not None}

    def _start_thread(self) -> bool:
        if self._thread is None and self._queue is None:
            self._queue = queue.Queue()
            thread = threading.Thread(target=self._run, name="ort-ckpt-hash", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # interpreter shutting down
                return False
            self._thread = thread
        return self._thread is not None

    def _run(self) -> None:
        q = self._queue
        assert q is not None
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                item[0].update(item[1])
            finally:
                q.task_done()


class _Writer:
    """Writes one file's pieces in order, each from its own memory, in steps that end on multiples of
    ``BEHIND_BYTES`` of the file: pieces (metadata, whole small tensors, the part of a large one up to the step's end)
    are gathered by reference and written with one ``writev`` per step, and the write-behind then sends that step to
    the disk (a chunk converted into the save's scratch buffer is written at once: the next chunk reuses it).
    Writes that end anywhere are slower than one buffer written in the same steps; gathered on step boundaries they
    are not (docs/performance.md, ``benchmarks/write_patterns.py``). No byte is copied, so no fresh
    memory is touched (a staging buffer cost a copy and, on VMs, slow first touches)."""

    def __init__(self, out: BinaryIO, hashing: _Hashing) -> None:
        self.out = out
        self.hashing = hashing
        self.pending: list[memoryview] = []
        self.pending_bytes = 0
        self.total = 0
        self.behind = WriteBehind.open(out)
        self.fd = _fileno(out)  # None: a file object of another file system (fsspec), written with plain writes

    def small(self, data: bytes | memoryview) -> None:
        self._add(memoryview(data).cast("B"), None)

    def blob(self, tensors: _Tensors, key: int) -> None:
        seen = 0
        h = self.hashing.start(key)
        for chunk, scratch in tensors.chunks(key):
            seen += chunk.nbytes
            self._add(chunk.cast("B"), h)
            if scratch:  # the next chunk overwrites this one: write and hash it first
                self._flush()
                self.hashing.drain()
        entry = tensors.entries[key]
        if seen != entry.nbytes:
            raise CheckpointSaveError(f"tensor {entry.name!r} changed size while it was being saved "
                                      f"({entry.nbytes} bytes planned, {seen} found)", tensors.path)

    def close(self) -> int:
        self._flush()
        return self.total

    def _add(self, view: memoryview, h: Any) -> None:
        """Gather ``view`` up to the step's end (hashing each part as it is gathered, large parts on the helper
        thread while the step before is written), writing every step that fills."""
        while view:
            part = view[:BEHIND_BYTES - (self.total + self.pending_bytes) % BEHIND_BYTES]
            view = view[len(part):]
            self.hashing.update(h, part)
            self.pending.append(part)
            self.pending_bytes += len(part)
            if (self.total + self.pending_bytes) % BEHIND_BYTES == 0:
                self._flush()

    def _flush(self) -> None:
        views, self.pending, self.pending_bytes = self.pending, [], 0
        if not hasattr(os, "writev") or portable_io() or self.fd is None:  # Windows, the portable path, fsspec
            for view in views:
                while view:
                    n = self.out.write(view)
                    view = view[n:]
                    self.total += n
        else:
            fd, first = self.fd, 0
            while first < len(views):
                n = os.writev(fd, views[first:first + _IOV_MAX])
                if n == 0:
                    raise OSError(errno.EIO, "the file accepted no more bytes", self.out.name)
                self.total += n
                while n and n >= len(views[first]):  # a short write (rare on regular files): go on after it
                    n -= len(views[first])
                    first += 1
                if n:
                    views[first] = views[first][n:]
        if self.behind is not None:
            self.behind.advance(self.total)
