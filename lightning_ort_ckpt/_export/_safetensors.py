"""Hugging Face's safetensors files, written a tensor at a time: ``model.safetensors``, or past a size numbered
shards with ``model.safetensors.index.json`` (the names and index ``save_pretrained`` writes, which
``from_pretrained`` reads).

The layout (github.com/huggingface/safetensors): 8 bytes little-endian, the length of a JSON header (each tensor's
dtype, shape and byte range, and ``__metadata__``) padded with spaces to a multiple of 8; then the tensors' bytes,
little-endian and row-major, in header order. The header is planned from names, dtypes and shapes alone, so each
tensor is read (:attr:`Entry.read`), written and let go before the next is read: memory is one tensor's, whatever
the model's size. Written by us, not the ``safetensors`` package: no dependency, every dtype (integers and bool
included).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
          torch.int16: "I16", torch.int8: "I8", torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16",
          torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64"}
"""torch dtype -> the safetensors name of it (the ones ``safetensors.torch`` reads back as the same dtype)."""


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its name in the file, dtype and shape, and how to get its bytes when its turn comes
    (``read`` returns exactly ``nbytes`` bytes, little-endian, row-major)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], Any]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def shards(entries: Sequence[Entry], max_shard_size: int) -> list[list[Entry]]:
    """``entries`` in order, cut into files of at most ``max_shard_size`` bytes of tensors each (a tensor larger
    than that gets a file of its own), as ``save_pretrained`` cuts them."""
    out: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if out[-1] and size + entry.nbytes > max_shard_size:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += entry.nbytes
    return out


def file_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write(entries: Sequence[Entry], folder: str, *, max_shard_size: int, metadata: dict[str, str]) -> list[str]:
    """Write ``entries`` into ``folder`` as ``model.safetensors``, or shards and their index; returns the files'
    paths. Each file is written under a temporary name and renamed when whole; weight files of an earlier export
    in ``folder`` that this one does not replace (other shard counts) are removed afterwards, so
    ``from_pretrained`` finds this export only."""
    groups = shards(entries, max_shard_size)
    names = file_names(len(groups))
    os.makedirs(folder, exist_ok=True)
    written = [_write_file(group, os.path.join(folder, name), metadata) for group, name in zip(groups, names)]
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.name: name for group, name in zip(groups, names) for e in group}}
        written.append(_replace_with(os.path.join(folder, INDEX), json.dumps(index, indent=2).encode() + b"\n"))
    for stale in os.listdir(folder):
        if (stale == SINGLE or stale == INDEX or _SHARD.fullmatch(stale)) and os.path.join(folder, stale) not in written:
            os.unlink(os.path.join(folder, stale))
    return written


def header(entries: Sequence[Entry], metadata: dict[str, str]) -> bytes:
    """The length-prefixed JSON header of a file holding ``entries`` in order."""
    doc: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        doc[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_file(entries: Sequence[Entry], path: str, metadata: dict[str, str]) -> str:
    temp = f"{path}.partial"
    try:
        with open(temp, "wb") as f:
            f.write(header(entries, metadata))
            for e in entries:
                data = memoryview(e.read()).cast("B")
                if len(data) != e.nbytes:
                    raise ValueError(f"{e.name!r} gave {len(data)} bytes, not {e.nbytes}")
                f.write(data)
                del data  # the tensor's memory goes before the next is read
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return path


def _replace_with(path: str, content: bytes) -> str:
    temp = f"{path}.partial"
    with open(temp, "wb") as f:
        f.write(content)
    os.replace(temp, path)
    return path
