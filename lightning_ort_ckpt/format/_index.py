"""The index of an ODTC checkpoint: what tensors it holds, where their bytes are, and the scalars and properties
around them, parsed from the file's FlatBuffer with every offset and length checked before it is trusted.

:class:`CheckpointIndex` checks the identifier, the version, that every offset and length is inside the file, that
dims are non-negative and that ``numel x itemsize`` equals the stored length (Python integers: no overflow), and
parses the checksum record (``_checksums``). Any fault raises :class:`CorruptCheckpointError` naming the file and the
fault; nothing is allocated from a size the file claims before that size is checked against the file. It reads
nothing but the buffer it is given (the mapped FlatBuffer): the files, their checks and the tensors' bytes are the
reader's (``_reader``, ``_files``).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import CorruptCheckpointError
from . import _checksums
from ._contents import PropertyValue
from ._dtypes import DataType
from ._flatbuffers import Verifier
from ._schema import (EXTERNAL_DATA_OFFSET_DEFAULT, FILE_IDENTIFIER, VERSION, CheckpointSlot, ModuleStateSlot,
                      OptimizerGroupSlot, ParameterOptimizerStateSlot, PropertyBagSlot, PropertySlot, TensorSlot)

Storage = Literal["inline", "external", "strings", "none"]
Kind = Literal["trainable", "frozen", "momentum"]

_MAX_NDIM = 64  # numpy's limit (torch's is the same or higher)
_MAX_ARRAY_BYTES = 2**63 - 1  # numpy and torch strides are int64: itemsize x the nonzero dims must fit


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


class Described:
    """What the metadata of a checkpoint says: the index has it, and the reader shows it as its own."""

    version: int
    nominal: bool
    has_external_data: bool
    trainable: dict[str, TensorInfo]
    frozen: dict[str, TensorInfo]
    optimizer_groups: dict[str, GroupInfo]
    properties: dict[str, PropertyValue]
    checksums: _checksums.Recorded | None
    """The tensor checksums the file records (None for a file ORT wrote: it records none)."""


class CheckpointIndex(Described):
    """The parsed metadata of one checkpoint, validated (see the module's doc). ``buffer`` is the file's FlatBuffer
    (mapped), ``path`` the file it came from (in errors)."""
    external: list[TensorInfo]
    """The tensors whose bytes are in the ``.data`` file."""
    keys: dict[int, str]
    """Each tensor's (by ``id`` of its :class:`TensorInfo`) key in the checksum record."""

    def __init__(self, buffer: Any, path: str) -> None:
        self._mm = buffer
        self.path = path
        self._parse()
        self._read_checksums()

    def tensors(self) -> list[TensorInfo]:
        """Every tensor: trainable, frozen, then optimizer momentums."""
        out = [*self.trainable.values(), *self.frozen.values()]
        for group in self.optimizer_groups.values():
            for momentums in group.states.values():
                out.extend(momentums.values())
        return out

    def check_data_size(self, size: int, data_path: str) -> None:
        """Raise unless every external tensor lies within the first ``size`` bytes of the ``.data`` file."""
        for info in self.external:
            if info.offset + info.nbytes > size:
                raise self._fail(f"{info.kind} tensor {info.name!r} needs bytes {info.offset:,}..."
                                 f"{info.offset + info.nbytes:,} of {data_path}, which has only {size:,}")

    def strings(self, info: TensorInfo) -> list[str]:
        """A STRING tensor's values (checked while parsing)."""
        p = Verifier(self._mm, self._fail)
        return [p.string(off, f"{info.name} string") for off in info.string_offsets]

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
        self.external = []
        ms_pos = p.offset(root, CheckpointSlot.MODULE_STATE)
        if ms_pos is not None:
            ms = p.table(ms_pos, "module_state")
            self.nominal = bool(p.scalar(ms, ModuleStateSlot.IS_NOMINAL_STATE, "?", False))
            self.has_external_data = bool(p.scalar(ms, ModuleStateSlot.HAS_EXTERNAL_DATA, "?", False))
            seen: set[str] = set()
            slots: tuple[tuple[int, Kind, dict[str, TensorInfo]], ...] = (
                (ModuleStateSlot.REQUIRES_GRAD_PARAMS, "trainable", self.trainable),
                (ModuleStateSlot.FROZEN_PARAMS, "frozen", self.frozen))
            for slot, kind, target in slots:
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
            self.external.append(info)
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

    def _read_checksums(self) -> None:
        text = self.properties.pop(_checksums.PROPERTY, None)  # ours, not the user's: never handed back as one
        self.keys = {id(i): _checksums.param_key(n)
                     for n, i in (*self.trainable.items(), *self.frozen.items())}
        for g in self.optimizer_groups.values():
            for param, momentums in g.states.items():
                self.keys.update((id(i), _checksums.state_key(g.name, param, m)) for m, i in momentums.items())
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
            key = self.keys[id(info)]
            present.add(key)
            if info.storage in ("inline", "external") and key not in self.checksums.digests:
                raise self._fail(f"{info.kind} tensor {info.name!r} has no recorded checksum although the file "
                                 "records them: its name or the checksum record is damaged")
        missing = sorted(self.checksums.digests.keys() - present)
        if missing:
            raise self._fail(f"{missing[0].split(':', 1)[1]!r} was saved but is not in the file ({len(missing)} "
                             "tensor(s) missing): its structure or the checksum record is damaged")


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
