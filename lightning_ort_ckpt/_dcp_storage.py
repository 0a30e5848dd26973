"""Sharded checkpoints in our format, under ``torch.distributed.checkpoint`` (DCP).

DCP plans (which rank saves which chunk of which tensor: replicated tensors once, a DTensor's shards by their
owners; on load, which saved chunks fill which part of each rank's tensors, at any world size); we store. A sharded
checkpoint is a DIRECTORY (Lightning names it ``epoch=3-step=400.ckpt``) holding:

- ``shard-<save id>-<rank>.odtc``: one ODTC file per writing rank (a ``.data`` companion past 2 GiB), written by
  the format's writer straight from each tensor's memory, every chunk a tensor named ``<fqn>@<offsets>`` with our
  per-tensor checksum;
- :data:`METADATA_NAME`: JSON written LAST, by the coordinator, once every rank's file is durable (each rank's
  write commits durably before DCP gathers the results that ``finish`` receives). It holds DCP's ``Metadata`` in our
  own encoding (each tensor's dtype, global size and chunks, and which file and name hold each chunk) and the saved
  tree with its non-tensor values encoded by ``_translation.values``: DCP's own ``.metadata`` and its ``BYTE_IO``
  items are pickles, so neither is ever written (the tree is split before DCP plans: DCP sees tensors only).

A directory without the metadata file is not a checkpoint. Saving over an existing checkpoint writes the new shard
files beside the old ones (a new save id) and then replaces the metadata file atomically (the store's commit: a
rename on a local disk, a completed single-object upload on S3/GCS/Azure): until that moment the old checkpoint is
whole, after it the new one; the old save's files are removed only then. A save that fails removes what it wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint import (DefaultLoadPlanner, DefaultSavePlanner, LoadPlan, LoadPlanner, Metadata,
                                          SavePlan, SavePlanner, StorageReader, StorageWriter)
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ._translation import values
from .errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from .format import CheckpointContents, CheckpointReader, TensorInfo, save_checkpoint
from .format._atomic import FOLDER_COMMIT_NAME
from .format._store import StorageOptions, Store, is_remote, store_for

METADATA_NAME = FOLDER_COMMIT_NAME
"""The metadata file inside a sharded checkpoint directory; its presence is what makes the directory a checkpoint
(the stores, which delete it first when they remove a folder, know it by the format layer's name)."""

FORMAT = "lightning-ort-ckpt/sharded"
VERSION = 1
_SHARD = re.compile(r"shard-[0-9a-f]{16}-\d{5,}\.odtc")
_MAX_METADATA_BYTES = 1 << 30


@dataclass(frozen=True)
class _Location:
    """Where one saved chunk lives: a shard file of the directory and the tensor's name in it."""

    file: str
    name: str


def join(path: str, name: str) -> str:
    """``name`` inside the directory ``path`` (a local path or a URL)."""
    return path.rstrip("/") + "/" + name if is_remote(path) else os.path.join(path, name)


def _fqn(path: tuple[str, ...]) -> str:
    """DCP's key of the tensor at ``path`` in the tree: its keys joined by ``/`` (``~`` and ``/`` escaped as in
    JSON pointers), the same on every rank and at every world size."""
    return "/".join(p.replace("~", "~0").replace("/", "~1") for p in path)


def _flatten(state: dict[str, Any], path: str, error: type[CheckpointError]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The tree encoded with its tensors replaced by their keys, and those tensors by key."""
    flat: dict[str, torch.Tensor] = {}

    def sink(where: tuple[str, ...], tensor: torch.Tensor) -> str:
        key = _fqn(where)
        if key in flat:
            raise error(f"two tensors of the state have the same key {key!r} (keys that differ only in type, such "
                        "as 0 and '0'); rename one", path)
        flat[key] = tensor
        return key

    return values.encode(state, sink), flat


# -- saving ---------------------------------------------------------------------------------------------------------
class OrtStorageWriter(StorageWriter):
    """DCP's ``StorageWriter`` of ours: each rank writes one ODTC file of its chunks; the coordinator writes the
    metadata last. ``tree`` is this rank's encoded tree (the coordinator's is the one kept)."""

    def __init__(self, path: str, tree: Any, storage_options: StorageOptions | None = None) -> None:
        super().__init__()
        self.path = path
        self.tree = tree
        self.store: Store = store_for(path, storage_options)
        self.is_coordinator = False
        self.files: list[str] = []
        self.written: str | None = None
        self.committed = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """One writer serves one save of one path."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: a fresh save id names every rank's file (its plan carries the name to the rank)."""
        save_id = secrets.token_hex(8)
        self.files = [f"shard-{save_id}-{rank:05d}.odtc" for rank in range(len(plans))]
        return [replace(plan, storage_data=name) for plan, name in zip(plans, self.files)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's chunks, streamed from their own memory into its file (durable when this returns)."""
        name = plan.storage_data
        contents = CheckpointContents()
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:  # pragma: no cover - save_sharded hands DCP tensors only
                raise CheckpointSaveError(f"internal error: {item.index.fqn!r} is no tensor", self.path)
            tensor = planner.resolve_data(item)
            key = f"{item.index.fqn}@{','.join(map(str, item.index.offset or ()))}"
            contents.frozen[key] = tensor
            results.append(WriteResult(index=item.index, size_in_bytes=tensor.numel() * tensor.element_size(),
                                       storage_data=_Location(name, key)))
        self.written = join(self.path, name)
        save_checkpoint(contents, self.written, store=self.store)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, after every rank's file is durable: the metadata file, then the old save's files go."""
        where = {r.index: r.storage_data for rank in results for r in rank}
        tensors = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):  # pragma: no cover - DCP saw tensors only
                raise CheckpointSaveError(f"internal error: {fqn!r} is no tensor", self.path)
            chunks = []
            for chunk in md.chunks:
                loc = where[MetadataIndex(fqn, chunk.offsets)]
                chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "file": loc.file,
                               "name": loc.name})
            tensors[fqn] = {"dtype": str(md.properties.dtype).removeprefix("torch."), "size": list(md.size),
                            "chunks": chunks}
        doc = {"format": FORMAT, "version": VERSION, "files": self.files, "tensors": tensors, "tree": self.tree}
        data = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        meta = join(self.path, METADATA_NAME)
        try:
            with self.store.writing(meta, with_data=False, required_bytes=len(data)) as files:
                files.main.write(data)
        except OSError as e:
            raise CheckpointSaveError(f"cannot write {METADATA_NAME} ({e.strerror or e})", self.path) from e
        self.committed = True
        _remove_other_saves(self.store, self.path, set(self.files))

    def discard(self) -> None:
        """After a failed save: remove this rank's file, unless the save was committed after all."""
        if self.written is not None and not self.committed:
            with contextlib.suppress(Exception):
                if self.store.exists(self.written):
                    self.store.remove(self.written)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen by DCP from a path: save_sharded passes it


def _remove_other_saves(store: Store, path: str, keep: set[str]) -> None:
    """Best effort: the shard files of earlier (replaced or failed) saves of this directory. The new checkpoint is
    committed already; a file left here is only space, removed by the next save of this path."""
    with contextlib.suppress(Exception):
        for file in store.list_files(path, recursive=False):
            base = file.replace("\\", "/").rsplit("/", 1)[-1]
            if _SHARD.fullmatch(base) and base not in keep:
                with contextlib.suppress(Exception):
                    store.remove(file)


def save_sharded(state: dict[str, Any], path: str, *, storage_options: dict[str, Any] | None = None,
                 process_group: Any = None) -> None:
    """Every rank calls it with its own state (leaves: ``torch.Tensor``, DTensor, or any value ``_translation.values``
    encodes; nested dicts and lists as in Lightning checkpoint dicts and optimizer state dicts). DCP plans (replicated
    tensors saved once), each rank writes its shards, the coordinator (rank 0) writes the metadata last: the directory
    is a checkpoint only once that file exists. Non-tensor leaves are taken from rank 0. Works without a process group
    (one process). Raises :class:`CheckpointSaveError` naming the path on failure; an existing checkpoint of the same
    path is replaced only once the new one is complete."""
    path = os.fspath(path)
    tree, flat = _flatten(state, path, CheckpointSaveError)
    writer = OrtStorageWriter(path, tree, storage_options)
    try:
        with _quiet():
            dcp_save(flat, storage_writer=writer, planner=DefaultSavePlanner(flatten_state_dict=False),
                     process_group=process_group, no_dist=_no_dist())
    except CheckpointException as e:
        writer.discard()
        raise _reported(e, path, CheckpointSaveError, "sharded save failed") from None
    except CheckpointError:
        writer.discard()
        raise
    except Exception as e:
        writer.discard()
        raise CheckpointSaveError(f"sharded save failed: {type(e).__name__}: {e}", path) from e


def _no_dist() -> bool:
    """One process: no collectives."""
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (``no_dist``): that is our documented case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _reported(e: CheckpointException, path: str, kind: type[CheckpointError], what: str) -> CheckpointError:
    """Our error out of DCP's: a rank's own :class:`CheckpointError` as it was, anything else named under ``kind``."""
    for rank, failure in sorted(e.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointError):
            return exc
    rank, failure = min(e.failures.items())
    exc = failure[0] if isinstance(failure, tuple) else failure
    return kind(f"{what} on rank {rank}: {type(exc).__name__}: {exc}", path)


# -- loading --------------------------------------------------------------------------------------------------------
def read_metadata(path: str, storage_options: StorageOptions | None = None) -> dict[str, Any]:
    """The checked metadata document of the sharded checkpoint ``path``; :class:`CorruptCheckpointError` naming the
    file when it is missing (not a committed checkpoint) or damaged."""
    store = store_for(path, storage_options)
    meta = join(path, METADATA_NAME)
    if not store.exists(meta):
        raise CorruptCheckpointError(f"not a sharded checkpoint: it has no {METADATA_NAME} (a save that did not "
                                     "finish, or another kind of directory)", path)
    try:
        with store.fetched(meta) as local, open(local, "rb") as f:
            data = f.read(_MAX_METADATA_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read the metadata file ({e.strerror or e})", meta) from None
    try:
        if len(data) > _MAX_METADATA_BYTES:
            raise ValueError("it is larger than 1 GiB")
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("it is not the metadata of a lightning-ort-ckpt sharded checkpoint")
        if not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
            raise ValueError(f"version {doc.get('version')!r} is not one this lightning-ort-ckpt reads (upgrade)")
        files = set(doc["files"])
        if not all(isinstance(f, str) and _SHARD.fullmatch(f) for f in files):
            raise ValueError("it names a file that is not a shard file of the directory")
        for fqn, t in doc["tensors"].items():
            _check_tensor(fqn, t, files)
        if "tree" not in doc:
            raise ValueError("the saved tree is missing")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"damaged metadata: {e}", meta) from None
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


def dtype_of(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor type {name!r}")
    return dtype


def _dcp_metadata(doc: dict[str, Any]) -> Metadata:
    """DCP's ``Metadata`` from our document (``storage_data``: each chunk's :class:`_Location`)."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, _Location] = {}
    for fqn, t in doc["tensors"].items():
        chunks = []
        for c in t["chunks"]:
            offsets = torch.Size(c["offsets"])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(c["sizes"])))
            storage[MetadataIndex(fqn, offsets)] = _Location(c["file"], c["name"])
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype_of(t["dtype"])), torch.Size(t["size"]),
                                           chunks)
    return Metadata(state_dict_metadata=state, storage_data=storage)


class ShardFiles:
    """The open shard files of one sharded checkpoint (fetched from a remote store as they are first needed), and
    the one way a saved chunk is read: into memory of its own, its checksum verified, its type and shape checked
    against the metadata."""

    def __init__(self, path: str, storage_options: StorageOptions | None = None) -> None:
        self.path = path
        self.store = store_for(path, storage_options)
        self._open: dict[str, CheckpointReader] = {}
        self._stack = contextlib.ExitStack()

    def chunk(self, file: str, name: str, dtype: torch.dtype, sizes: tuple[int, ...],
              into: torch.Tensor | None = None) -> torch.Tensor:
        """The saved chunk, read into memory of its own, or straight into ``into`` (a contiguous CPU tensor of its
        type and shape: a load's target)."""
        full = join(self.path, file)
        reader = self._reader(file)
        info = reader.frozen.get(name)
        if info is None:
            raise CorruptCheckpointError(f"tensor {name!r}, named in the checkpoint's {METADATA_NAME}, is missing",
                                         full)
        if info.dtype.to_torch() != dtype or info.shape != tuple(sizes):
            raise CorruptCheckpointError(f"tensor {name!r} is {info.dtype.name} {list(info.shape)}, but "
                                         f"{METADATA_NAME} says {dtype} {list(sizes)}", full)
        try:
            if into is not None:
                reader.read_bytes(info, into.reshape(-1).view(torch.uint8).numpy())
                return into
            return _as_torch(reader.read_bytes(info), info)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(str(e).removeprefix(f"{reader.path}: "), full) from None

    def tensor(self, t: dict[str, Any]) -> torch.Tensor:
        """A whole tensor of the metadata (``t``), assembled from its chunks: the tensor's memory, plus one chunk
        while it is copied in (none when one chunk is the whole tensor)."""
        dtype, size = dtype_of(t["dtype"]), tuple(t["size"])
        chunks = t["chunks"]
        if len(chunks) == 1 and tuple(chunks[0]["sizes"]) == size:
            return self.chunk(chunks[0]["file"], chunks[0]["name"], dtype, size)
        out = torch.empty(size, dtype=dtype)
        for c in chunks:
            out[tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["sizes"]))] = \
                self.chunk(c["file"], c["name"], dtype, tuple(c["sizes"]))
        return out

    def _reader(self, file: str) -> CheckpointReader:
        if file not in self._open:
            full = join(self.path, file)
            if not self.store.exists(full):
                raise CorruptCheckpointError(f"shard file {file}, named in the checkpoint's {METADATA_NAME}, is "
                                             "missing", full)
            local = self._stack.enter_context(self.store.fetched(full))
            try:
                self._open[file] = self._stack.enter_context(CheckpointReader(local, verify=True))
            except CheckpointError as e:
                raise type(e)(str(e).removeprefix(f"{local}: "), full) from None
        return self._open[file]

    def close(self) -> None:
        self._open.clear()
        self._stack.close()

    def __enter__(self) -> ShardFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_torch(raw: np.ndarray, info: TensorInfo) -> torch.Tensor:
    dtype = info.dtype.to_torch()
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype)
    if raw.ctypes.data % info.dtype.itemsize:
        raw = raw.copy()
    return torch.from_numpy(raw).view(dtype).reshape(info.shape)


class OrtStorageReader(StorageReader):
    """DCP's ``StorageReader`` of ours: reads only the chunks the load plan asks for, each verified."""

    def __init__(self, path: str, doc: dict[str, Any], storage_options: StorageOptions | None = None) -> None:
        super().__init__()
        self.path = path
        self.doc = doc
        self.storage_options = storage_options
        self.metadata = _dcp_metadata(doc)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """One reader serves one load of one path."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: the metadata was read (and checked) before the load started."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        storage = self.metadata.storage_data
        items = sorted(plan.items, key=lambda i: (storage[i.storage_index].file, storage[i.storage_index].name))
        with ShardFiles(self.path, self.storage_options) as files:
            for item in items:
                if item.type == LoadItemType.BYTE_IO:  # pragma: no cover - we never save any
                    raise CorruptCheckpointError(f"{item.storage_index.fqn!r} is no tensor", self.path)
                loc = storage[item.storage_index]
                md = self.metadata.state_dict_metadata[item.storage_index.fqn]
                sizes = next(c.sizes for c in md.chunks if c.offsets == item.storage_index.offset)
                target = planner.resolve_tensor(item).detach()
                if (tuple(item.lengths) == tuple(sizes) and not any(item.storage_offsets) and target.numel()
                        and target.device.type == "cpu" and target.is_contiguous()
                        and target.dtype == md.properties.dtype):  # the whole chunk: read into the target itself
                    files.chunk(loc.file, loc.name, md.properties.dtype, tuple(sizes), into=target)
                else:
                    stored = files.chunk(loc.file, loc.name, md.properties.dtype, tuple(sizes))
                    target.copy_(stored[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))])
                planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen by DCP from a path: load_sharded passes it


def load_sharded(state: dict[str, Any], path: str, *, storage_options: dict[str, Any] | None = None,
                 process_group: Any = None, others: bool = True) -> dict[str, Any]:
    """Every rank calls it. Fills every tensor leaf of ``state`` (Tensor or DTensor) IN PLACE from the checkpoint,
    resharded by DCP's planner (another world size works), and returns the whole saved tree with the tensors of
    ``state`` in their places and every saved non-tensor value decoded (keys absent from ``state`` included, so the
    caller gets loops, callbacks, hyper-parameters). Of the tensors ``state`` does not ask for, those saved whole
    (one chunk: a callback's score, a replicated buffer) are read into the returned tree; sharded ones are not read
    and come back as None; with ``others=False`` none of them is read (all None: the saved values alone, for a
    caller that looks at them before it asks for tensors). Raises :class:`CorruptCheckpointError` naming the file on
    damage (checksums are verified)."""
    path = os.fspath(path)
    doc = read_metadata(path, storage_options)
    _, asked = _flatten(state, path, CheckpointError)
    saved = doc["tensors"]
    missing = sorted(asked.keys() - saved.keys())
    if missing:
        raise CheckpointError(f"the checkpoint has no tensor {missing[0]!r} ({len(missing)} of the state's "
                              f"{len(asked)} missing)", path)
    for fqn, tensor in asked.items():
        if tuple(tensor.shape) != tuple(saved[fqn]["size"]):
            raise CheckpointError(f"tensor {fqn!r} has shape {list(tensor.shape)} here but "
                                  f"{saved[fqn]['size']} in the checkpoint", path)
    whole = {fqn: torch.empty(t["size"], dtype=dtype_of(t["dtype"])) for fqn, t in saved.items()
             if others and fqn not in asked and len(t["chunks"]) == 1 and t["chunks"][0]["sizes"] == t["size"]}
    try:
        with _quiet():
            dcp_load({**asked, **whole}, storage_reader=OrtStorageReader(path, doc, storage_options),
                     planner=DefaultLoadPlanner(flatten_state_dict=False), process_group=process_group,
                     no_dist=_no_dist())
    except CheckpointException as e:
        raise _reported(e, path, CorruptCheckpointError, "sharded load failed") from None
    tensors = {**whole, **asked}
    try:
        return values.decode(doc["tree"], lambda key: tensors.get(key))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"damaged metadata: the saved tree does not decode ({e})",
                                     join(path, METADATA_NAME)) from None


def is_sharded_checkpoint(path: str, storage_options: dict[str, Any] | None = None) -> bool:
    """True for a COMMITTED sharded checkpoint directory of ours (its metadata file exists and parses); False for a
    file, a missing path, or a half-written directory."""
    try:
        read_metadata(os.fspath(path), storage_options)
    except (CheckpointError, OSError, ValueError):
        return False
    return True

