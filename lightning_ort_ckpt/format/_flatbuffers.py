"""FlatBuffers, both ways: :class:`LayoutBuilder` plans the bytes of a FlatBuffer exactly as flatbuffers' C++
``FlatBufferBuilder`` lays them out, and :class:`Verifier` reads them back with every offset checked.

ORT writes checkpoints with the C++ builder, so matching its layout byte for byte means matching its rules:
back-to-front building, ``PreAlign`` that skips zero-length data, scalars equal to their default omitted, vtables
trimmed of trailing absent fields and deduplicated against every earlier vtable. Unlike a real builder, tensor
payloads are kept as :class:`Blob` references, so the planned file can be streamed to disk from the tensors' own
memory without ever assembling it in memory.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple, Union

MAX_FLATBUFFER_SIZE = 2**31 - 1
"""FlatBuffers offsets are signed 32-bit: no buffer may reach 2 GiB."""


class LayoutTooLarge(Exception):
    """The buffer being planned passed ``MAX_FLATBUFFER_SIZE``; offsets would no longer fit its 32-bit fields."""


class Blob(NamedTuple):
    """A placeholder for ``nbytes`` payload bytes that the writer supplies later, identified by ``key``."""

    key: int
    nbytes: int


Piece = Union[bytes, Blob]


class LayoutBuilder:
    """A back-to-front FlatBuffer builder whose output is a list of byte runs and blob placeholders.

    Offsets returned by the methods are, as in flatbuffers, distances from the end of the buffer.
    """

    def __init__(self) -> None:
        self._rev = bytearray()  # metadata bytes of the current run, reversed
        self._done: list[Piece] = []  # finished pieces, in build order (the reverse of file order)
        self.size = 0
        self._minalign = 1
        self._vtables: dict[bytes, int] = {}
        self._fields: list[tuple[int, int]] = []
        self._table_start = -1

    # -- primitives ---------------------------------------------------------------------------------------------
    def _fill(self, n: int) -> None:
        if n:
            self._rev += bytes(n)
            self._grow(n)

    def _push(self, data: bytes) -> None:
        self._rev += data[::-1]
        self._grow(len(data))

    def _grow(self, n: int) -> None:
        self.size += n
        if self.size > MAX_FLATBUFFER_SIZE:
            raise LayoutTooLarge(self.size)

    def _align(self, n: int) -> None:
        self._minalign = max(self._minalign, n)
        self._fill(-self.size % n)

    def _prealign(self, length: int, n: int) -> None:
        if length == 0:  # C++ PreAlign returns early for empty data: empty vectors are only 4-aligned
            return
        self._minalign = max(self._minalign, n)
        self._fill(-(self.size + length) % n)

    def _push_uoffset(self, off: int) -> None:
        self._align(4)
        self._push(struct.pack("<I", self.size - off + 4))

    # -- objects ------------------------------------------------------------------------------------------------
    def string(self, value: str) -> int:
        data = value.encode("utf-8")
        self._prealign(len(data) + 1, 4)
        self._fill(1)
        self._push(data)
        return self._end_vector(len(data))

    def string_blob(self, blob: Blob) -> int:
        """A string of ``blob.nbytes`` ASCII bytes whose contents the writer supplies later."""
        self._prealign(blob.nbytes + 1, 4)
        self._fill(1)
        if blob.nbytes:
            self._flush()
            self._done.append(blob)
            self._grow(blob.nbytes)
        return self._end_vector(blob.nbytes)

    def scalar_vector(self, data: bytes, count: int, alignment: int) -> int:
        """A vector of little-endian scalars already packed in ``data``."""
        self._prealign(len(data), 4)
        self._prealign(len(data), alignment)
        self._push(data)
        return self._end_vector(count)

    def blob_vector(self, blob: Blob) -> int:
        """A ``[uint8]`` vector whose contents the writer streams later."""
        self._prealign(blob.nbytes, 4)
        if blob.nbytes:
            self._flush()
            self._done.append(blob)
            self._grow(blob.nbytes)
        return self._end_vector(blob.nbytes)

    def offset_vector(self, offsets: list[int]) -> int:
        self._prealign(4 * len(offsets), 4)
        for off in reversed(offsets):
            self._push_uoffset(off)
        return self._end_vector(len(offsets))

    def _end_vector(self, count: int) -> int:
        self._align(4)
        self._push(struct.pack("<I", count))
        return self.size

    # -- tables -------------------------------------------------------------------------------------------------
    def start_table(self) -> None:
        self._fields = []
        self._table_start = self.size

    def add_scalar(self, slot: int, fmt: str, value: int | float | bool, default: int | float | bool) -> None:
        """Add a scalar field; like C++ (without force_defaults) a value equal to the default is not written."""
        if value == default:
            return
        data = struct.pack("<" + fmt, value)
        self._align(len(data))
        self._push(data)
        self._fields.append((4 + 2 * slot, self.size))

    def add_offset(self, slot: int, off: int | None) -> None:
        if off is None:
            return
        self._push_uoffset(off)
        self._fields.append((4 + 2 * slot, self.size))

    def end_table(self) -> int:
        self._align(4)
        table = self.size + 4  # where the soffset to the vtable ends up
        vt_size = max([4] + [voff + 2 for voff, _ in self._fields])
        vtable = [0] * (vt_size // 2)
        vtable[0], vtable[1] = vt_size, table - self._table_start
        for voff, off in self._fields:
            vtable[voff // 2] = table - off
        vt_bytes = struct.pack(f"<{len(vtable)}H", *vtable)
        existing = self._vtables.get(vt_bytes)
        if existing is not None:
            self._push(struct.pack("<i", existing - table))
        else:
            self._push(struct.pack("<i", vt_size))
            self._push(vt_bytes)
            self._vtables[vt_bytes] = self.size
        return table

    def finish(self, root: int, identifier: bytes) -> list[Piece]:
        """Close the buffer and return its pieces in file order."""
        self._prealign(4 + len(identifier), self._minalign)
        self._push(identifier)
        self._push_uoffset(root)
        self._flush()
        return self._done[::-1]

    def _flush(self) -> None:
        if self._rev:
            self._done.append(bytes(self._rev[::-1]))
            self._rev = bytearray()


# -- reading: the verifier -----------------------------------------------------------------------------------------
class Table:
    """A table the verifier has checked: its position, vtable and sizes, and where it is (for messages)."""

    __slots__ = ("pos", "vt", "vt_size", "obj_size", "where")

    def __init__(self, pos: int, vt: int, vt_size: int, obj_size: int, where: str) -> None:
        self.pos, self.vt, self.vt_size, self.obj_size, self.where = pos, vt, vt_size, obj_size, where


class Verifier:
    """Bounds- and alignment-checked FlatBuffers access (the checks of flatbuffers' Verifier), for the reader: every
    offset, size and alignment of a buffer read from disk is checked before it is followed, and ``fail`` (the
    reader's error for its file) says what is wrong where."""

    def __init__(self, buf: Any, fail: Any) -> None:
        self.buf = buf
        self.size = len(buf)
        self.fail = fail

    def _check(self, pos: int, nbytes: int, align: int, what: str) -> None:
        if pos < 0 or pos + nbytes > self.size:
            raise self.fail(f"{what} at byte {pos:,} lies outside the file ({self.size:,} bytes): truncated or damaged")
        if pos % align:
            raise self.fail(f"{what} at byte {pos:,} is not {align}-byte aligned")

    def u32(self, pos: int, what: str) -> int:
        self._check(pos, 4, 4, what)
        return struct.unpack_from("<I", self.buf, pos)[0]

    def table(self, pos: int, where: str) -> Table:
        self._check(pos, 4, 4, where)
        vt = pos - struct.unpack_from("<i", self.buf, pos)[0]
        self._check(vt, 4, 2, f"{where} vtable")
        vt_size, obj_size = struct.unpack_from("<HH", self.buf, vt)
        if vt_size < 4 or vt_size % 2:
            raise self.fail(f"{where} has a malformed vtable (size {vt_size})")
        self._check(vt, vt_size, 2, f"{where} vtable")
        if obj_size < 4:
            raise self.fail(f"{where} has a malformed table (size {obj_size})")
        self._check(pos, obj_size, 4, where)
        return Table(pos, vt, vt_size, obj_size, where)

    def _field(self, t: Table, slot: int, nbytes: int) -> int | None:
        entry = 4 + 2 * slot
        if entry + 2 > t.vt_size:
            return None
        voff = struct.unpack_from("<H", self.buf, t.vt + entry)[0]
        if voff == 0:
            return None
        if voff + nbytes > t.obj_size:
            raise self.fail(f"{t.where}: field {slot} lies outside its table")
        return t.pos + voff

    def scalar(self, t: Table, slot: int, fmt: str, default: Any) -> Any:
        size = struct.calcsize(fmt)
        pos = self._field(t, slot, size)
        if pos is None:
            return default
        self._check(pos, size, size, f"{t.where} field {slot}")
        return struct.unpack_from("<" + fmt, self.buf, pos)[0]

    def offset(self, t: Table, slot: int) -> int | None:
        pos = self._field(t, slot, 4)
        if pos is None:
            return None
        return pos + self.u32(pos, f"{t.where} field {slot}")

    def vector(self, pos: int, elem_size: int, what: str) -> tuple[int, int]:
        count = self.u32(pos, what)
        self._check(pos + 4, count * elem_size, min(elem_size, 8) if count else 1, what)
        return count, pos + 4

    def table_vector(self, t: Table, slot: int, what: str) -> list[int]:
        pos = self.offset(t, slot)
        return [] if pos is None else self.table_vector_at(pos, what)

    def table_vector_at(self, pos: int, what: str) -> list[int]:
        count, start = self.vector(pos, 4, what)
        rel = struct.unpack_from(f"<{count}I", self.buf, start)
        return [start + 4 * i + r for i, r in enumerate(rel)]

    def string(self, pos: int, what: str) -> str:
        length, start = self.vector(pos, 1, what)
        self._check(start + length, 1, 1, f"{what} terminator")
        if self.buf[start + length] != 0:
            raise self.fail(f"{what} is not NUL-terminated")
        try:
            return bytes(self.buf[start:start + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def string_field(self, t: Table, slot: int, what: str) -> str:
        pos = self.offset(t, slot)
        if pos is None:
            raise self.fail(f"{what} has no {('name' if slot == 0 else 'value')}")
        return self.string(pos, f"{what} name" if slot == 0 else what)
