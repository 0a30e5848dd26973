"""The metadata document of a sharded checkpoint: DCP's whole ``Metadata`` as pickle-free JSON, and back.

DCP's own ``.metadata`` is a pickle; ours is JSON holding the same things: every tensor's properties (dtype, layout,
``requires_grad``, memory format, pinned), global size and chunks, and which shard file and name hold each chunk;
every non-tensor item (DCP's ``BYTE_IO``) with the file and name of the uint8 tensor holding it and what it was
(``bytes``, an ``io.BytesIO``, or any other value, as ``_translation.values`` encodes it); the planner's data (the
nested key of each flattened fqn: what ``dcp_to_torch_save`` rebuilds the tree from), the storage meta and the DCP
version; and, for our own saves (``save_sharded``), the saved tree with its non-tensor values. Version 1 documents
(no ``bytes``, no ``dcp``) read as before.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)

from .._translation import values

FORMAT = "lightning-ort-ckpt/sharded"
VERSION = 2
SHARD = re.compile(r"shard-[0-9a-f]{16}-\d{5,}\.odtc")
KINDS = ("bytes", "bytesio", "value")
"""What a ``BYTE_IO`` item was: ``bytes`` and ``io.BytesIO`` are stored as their bytes, any other value as the JSON
text of ``_translation.values`` (its tensors beside it in the same shard file)."""


@dataclass(frozen=True)
class Location:
    """Where one saved item lives: a shard file of the directory and the tensor's name in it; ``kind`` is
    ``"tensor"`` for a chunk of a tensor, else one of :data:`KINDS`."""

    file: str
    name: str
    kind: str = "tensor"


def dtype_of(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor type {name!r}")
    return dtype


def _torch_attr(name: Any, kind: type) -> Any:
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, kind):
        raise ValueError(f"unknown {kind.__name__} {name!r}")
    return value


def _name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _no_tensor(where: tuple[str, ...], tensor: torch.Tensor) -> Any:
    raise ValueError(f"a tensor in the planner's data at {'/'.join(where)!r}")


def document(metadata: Metadata, where: dict[MetadataIndex, Location], files: list[str], tree: Any) -> dict[str, Any]:
    """The JSON document of ``metadata`` (``where``: each item's location, from the ranks' write results)."""
    tensors, blobs = {}, {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            loc = where[MetadataIndex(fqn)]
            blobs[fqn] = {"file": loc.file, "name": loc.name, "kind": loc.kind}
            continue
        chunks = []
        for chunk in md.chunks:
            loc = where[MetadataIndex(fqn, chunk.offsets)]
            chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "file": loc.file,
                           "name": loc.name})
        p = md.properties
        tensors[fqn] = {"dtype": _name(p.dtype), "size": list(md.size), "chunks": chunks,
                        "properties": {"layout": _name(p.layout), "requires_grad": bool(p.requires_grad),
                                       "memory_format": _name(p.memory_format), "pin_memory": bool(p.pin_memory)}}
    meta = metadata.storage_meta
    dcp = {"version": CURRENT_DCP_VERSION,
           "planner_data": values.encode(metadata.planner_data, _no_tensor),
           "storage_meta": None if meta is None else {
               "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
               "save_id": meta.save_id, "modules": list(meta.modules)}}
    return {"format": FORMAT, "version": VERSION, "files": files, "tensors": tensors, "bytes": blobs, "dcp": dcp,
            "tree": tree}


def encoded(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def parse(data: bytes) -> dict[str, Any]:
    """The checked document; ValueError (or KeyError, TypeError...) saying what is wrong."""
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError("it is not the metadata of a lightning-ort-ckpt sharded checkpoint")
    if not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
        raise ValueError(f"version {doc.get('version')!r} is not one this lightning-ort-ckpt reads (upgrade)")
    files = set(doc["files"])
    if not all(isinstance(f, str) and SHARD.fullmatch(f) for f in files):
        raise ValueError("it names a file that is not a shard file of the directory")
    for fqn, t in doc["tensors"].items():
        _check_tensor(fqn, t, files)
    for fqn, b in doc.setdefault("bytes", {}).items():
        if not isinstance(b, dict) or b.get("file") not in files or not isinstance(b.get("name"), str) \
                or b.get("kind") not in KINDS:
            raise ValueError(f"item {fqn!r} is malformed or in an unknown file: {b!r}")
    if "tree" not in doc:
        raise ValueError("the saved tree is missing")
    doc.setdefault("dcp", None)
    return doc


def _check_tensor(fqn: str, t: dict[str, Any], files: set[str]) -> None:
    if not isinstance(fqn, str) or not isinstance(t, dict):
        raise ValueError(f"tensor entry {fqn!r} is malformed")
    dtype_of(t["dtype"])
    size = t["size"]
    if not isinstance(size, list) or not all(isinstance(d, int) and d >= 0 for d in size):
        raise ValueError(f"tensor {fqn!r} has a bad size {size!r}")
    for c in t["chunks"]:
        offsets, sizes = c["offsets"], c["sizes"]
        if (len(offsets) != len(size) or len(sizes) != len(size) or c["file"] not in files
                or not isinstance(c["name"], str)
                or not all(isinstance(o, int) and isinstance(s, int) and 0 <= o and 0 <= s and o + s <= d
                           for o, s, d in zip(offsets, sizes, size))):
            raise ValueError(f"tensor {fqn!r} has a chunk outside it or in an unknown file: {c!r}")


def _properties(t: dict[str, Any]) -> TensorProperties:
    p = t.get("properties") or {}
    return TensorProperties(dtype=dtype_of(t["dtype"]), layout=_torch_attr(p.get("layout", "strided"), torch.layout),
                            requires_grad=bool(p.get("requires_grad", False)),
                            memory_format=_torch_attr(p.get("memory_format", "contiguous_format"),
                                                      torch.memory_format),
                            pin_memory=bool(p.get("pin_memory", False)))


def to_dcp(doc: dict[str, Any]) -> Metadata:
    """DCP's ``Metadata`` of a checked document (``storage_data``: each item's :class:`Location`); ValueError when a
    value in it does not decode."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Location] = {}
    for fqn, t in doc["tensors"].items():
        chunks = []
        for c in t["chunks"]:
            offsets = torch.Size(c["offsets"])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(c["sizes"])))
            storage[MetadataIndex(fqn, offsets)] = Location(c["file"], c["name"])
        state[fqn] = TensorStorageMetadata(_properties(t), torch.Size(t["size"]), chunks)
    for fqn, b in doc["bytes"].items():
        state[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = Location(b["file"], b["name"], b["kind"])
    metadata = Metadata(state_dict_metadata=state, storage_data=storage)
    dcp = doc["dcp"]
    if isinstance(dcp, dict):
        metadata.version = dcp.get("version")
        metadata.planner_data = values.decode(dcp.get("planner_data"), _no_source)
        meta = dcp.get("storage_meta")
        if isinstance(meta, dict):
            metadata.storage_meta = StorageMeta(checkpoint_id=meta.get("checkpoint_id"), save_id=meta.get("save_id"),
                                                modules=list(meta.get("modules") or []))
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _no_source(ref: Any) -> torch.Tensor:
    raise ValueError("the planner's data names a tensor")
