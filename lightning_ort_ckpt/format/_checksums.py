"""Per-tensor checksums: recorded while a save streams, checked when a load reads.

Every file this project writes carries, in the string property ``lightning_ort_ckpt.checksums`` (ORT keeps
properties it does not know and ignores them), one JSON document::

    {"algorithm": "xxh3_64", "groups": {"group0": 12}, "tensors": {"<key>": "<16 hex digits>", ...}}

``tensors`` maps a key per tensor (``param:<name>`` for a parameter or buffer, ``state:<group>/<param>/<momentum>``
for an optimizer momentum) to the XXH3-64 digest of the tensor's data type and shape (a 4-byte code and 8 bytes per
dimension, little-endian) followed by its bytes as stored (inline or in ``.data``): damage that turns a tensor into
another of the same size (dims swapped, a type code changed) is caught as well as damage to its bytes.
``groups`` is the optimizer step of each optimizer group at save time. ONNX Runtime keeps the property when it
re-saves a file, but an ORT that trained from the file changed the tensors: its optimizer step (or the set of groups
it saved) then differs from ``groups``, and the checksums are *stale*, not a sign of damage (:attr:`Recorded.stale`).

The document is planned with placeholder digests of fixed width, so its length is known before any tensor is read;
the writer fills in the digests once every tensor is streamed (one small write back into the file).

Why XXH3-64: it is not cryptographic (a checksum here detects damage, not tampering), it runs several times faster than
zlib.crc32 on one core, far above the disk (docs/performance.md has the figures), so hashing hides under the save's
writes and adds little to a load; ``xxhash`` is a small, maintained binding with wheels for every platform; 64 bits make an undetected random
error vanishingly unlikely (CRC-32 would leave 1 in 4 billion).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

PROPERTY = "lightning_ort_ckpt.checksums"
"""The string property holding the checksum document."""
ALGORITHM = "xxh3_64"
_WIDTH = 16  # hex digits of a 64-bit digest
_PLACEHOLDER = "0" * _WIDTH


def param_key(name: str) -> str:
    return f"param:{name}"


def state_key(group: str, param: str, momentum: str) -> str:
    return f"state:{group}/{param}/{momentum}"


def hasher(dtype: int, shape: tuple[int, ...]) -> Any:
    """A streaming hasher (``update(buffer)``, ``intdigest()``) for a tensor of ``dtype`` (the format's type code)
    and ``shape``, fed its header; the tensor's bytes follow. It releases the GIL on large buffers."""
    h = xxhash.xxh3_64()
    h.update(struct.pack(f"<i{len(shape)}q", dtype, *shape))
    return h


class Template:
    """The checksum document with placeholder digests, planned before streaming and filled in after it."""

    def __init__(self, keys: Iterable[str], groups: dict[str, int]) -> None:
        parts = [f'{{"algorithm":"{ALGORITHM}","groups":{json.dumps(groups, sort_keys=True)},"tensors":{{']
        pos = len(parts[0])
        self._slots: dict[str, int] = {}
        for i, key in enumerate(keys):
            entry = ("," if i else "") + json.dumps(key) + ':"'  # ensure_ascii: one byte per character
            self._slots[key] = pos + len(entry)
            parts.append(entry + _PLACEHOLDER + '"')
            pos += len(parts[-1])
        parts.append("}}")
        self.text = "".join(parts)

    def fill(self, digests: dict[str, int]) -> bytes:
        """The document's bytes with the digests in place (same length as :attr:`text`)."""
        out = bytearray(self.text.encode("ascii"))
        for key, pos in self._slots.items():
            out[pos:pos + _WIDTH] = f"{digests[key]:016x}".encode("ascii")
        return bytes(out)


@dataclass(frozen=True)
class Recorded:
    """What a file's checksum property says, compared with the file as it is now."""

    algorithm: str
    digests: dict[str, int]
    stale: str | None = None
    """Why the digests no longer describe the tensors although nothing is damaged (ORT trained and re-saved), or
    None when they must match."""

    @property
    def usable(self) -> bool:
        return self.algorithm == ALGORITHM and self.stale is None


def parse(text: Any, groups_now: dict[str, int]) -> Recorded:
    """The checksum document ``text``; ``groups_now`` maps the file's optimizer groups to their steps.

    Raises ValueError when the document is malformed (the reader words it as damage).
    """
    if not isinstance(text, str):
        raise ValueError("it is not a string")
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("algorithm"), str):
        raise ValueError("it names no algorithm")
    tensors, groups = doc.get("tensors"), doc.get("groups")
    if not isinstance(tensors, dict) or not isinstance(groups, dict):
        raise ValueError("it lacks its tensor or group table")
    digests = {}
    for key, value in tensors.items():
        if not isinstance(value, str) or len(value) != _WIDTH:
            raise ValueError(f"the checksum of {key!r} is malformed")
        digests[key] = int(value, 16)
    stale = None
    if groups != groups_now:
        if not _ort_trained(groups, groups_now):
            raise ValueError(f"the file's optimizer groups ({_steps(groups_now)}) are not those saved "
                             f"({_steps(groups)}), nor what ONNX Runtime makes of them")
        stale = (f"ONNX Runtime trained from this file and saved it again (optimizer steps {_steps(groups)} when "
                 f"lightning-ort-ckpt saved it, {_steps(groups_now)} now), so its tensors changed after the "
                 "checksums were recorded")
    return Recorded(doc["algorithm"], digests, stale)


def _ort_trained(saved: dict[str, Any], now: dict[str, int]) -> bool:
    """Whether ORT's optimizer explains how the groups changed: saved without optimizer state (no groups), a
    ``group0`` it created, steps that only went up. A renamed group or a step that went down is damage."""
    if not now:
        return True
    added = now.keys() - saved.keys()
    if not saved.keys() <= now.keys() or not added <= {"group0"}:
        return False
    if any(not isinstance(saved[g], int) or now[g] < saved[g] for g in saved):
        return False
    return bool(added) or any(now[g] > saved[g] for g in saved)


def _steps(groups: dict[str, Any]) -> str:
    return ", ".join(f"{g}: {s}" for g, s in sorted(groups.items())) or "no optimizer state"
