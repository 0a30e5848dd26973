"""Our ``torch.distributed.checkpoint`` ``StorageReader`` (public as ``lightning_ort_ckpt.dcp.OrtStorageReader``),
and :class:`ShardFiles`, the one way a saved chunk of a sharded folder (``_dcp_folder``) is read: checksums
verified, type and shape checked against the metadata. Non-tensor items are handed to the planner as the values
they were, never through a pickle."""

from __future__ import annotations

import contextlib
import io
import json
import os
from typing import Any

import numpy as np
import torch
from torch.futures import Future
from torch.distributed.checkpoint import DefaultLoadPlanner, LoadPlan, LoadPlanner, Metadata, StorageReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from . import _dcp_metadata
from ._dcp_folder import HEAD, METADATA_NAME, rank_metadata_name, read_metadata
from ._dcp_metadata import Location, dtype_of
from .._translation import values
from ..errors import CheckpointError, CorruptCheckpointError
from ..format import CheckpointReader, TensorInfo
from ..format._store import StorageOptions, Store, Stores, store_for

__all__ = ["OrtStorageReader", "ShardFiles"]


class ShardFiles:
    """The open shard files of one sharded checkpoint (fetched from a remote store as they are first needed), and
    the one way a saved chunk is read: into memory of its own, its checksum verified, its type and shape checked
    against the metadata."""

    def __init__(self, path: str, store: Store) -> None:
        self.path = path
        self.store = store
        self._open: dict[str, CheckpointReader] = {}
        self._stack = contextlib.ExitStack()

    def chunk(self, file: str, name: str, dtype: torch.dtype, sizes: tuple[int, ...],
              into: torch.Tensor | None = None) -> torch.Tensor:
        """The saved chunk, read into memory of its own, or straight into ``into`` (a contiguous CPU tensor of its
        type and shape: a load's target)."""
        reader, info = self._info(file, name)
        if info.dtype.to_torch() != dtype or info.shape != tuple(sizes):
            raise CorruptCheckpointError(f"tensor {name!r} is {info.dtype.name} {list(info.shape)}, but "
                                         f"{METADATA_NAME} says {dtype} {list(sizes)}",
                                         self.store.join(self.path, file))
        return self._read(file, reader, info, into)

    def stored(self, file: str, name: str) -> torch.Tensor:
        """A tensor of the file as it was saved (a non-tensor item's bytes, or a tensor nested in it)."""
        reader, info = self._info(file, name)
        return self._read(file, reader, info, None)

    def _info(self, file: str, name: str) -> tuple[CheckpointReader, TensorInfo]:
        reader = self._reader(file)
        info = reader.frozen.get(name)
        if info is None:
            raise CorruptCheckpointError(f"tensor {name!r}, named in the checkpoint's {METADATA_NAME}, is missing",
                                         self.store.join(self.path, file))
        return reader, info

    def _read(self, file: str, reader: CheckpointReader, info: TensorInfo, into: torch.Tensor | None) -> torch.Tensor:
        try:
            if into is not None:
                reader.read_bytes(info, into.reshape(-1).view(torch.uint8).numpy())
                return into
            return _as_torch(reader.read_bytes(info), info)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(str(e).removeprefix(f"{reader.path}: "),
                                         self.store.join(self.path, file)) from None

    def value(self, loc: Location) -> Any:
        """A non-tensor item: ``bytes``, an ``io.BytesIO`` (at position 0), or the value it was."""
        raw = self.stored(loc.file, loc.name)
        if raw.dtype != torch.uint8 or raw.dim() != 1:
            raise CorruptCheckpointError(f"item {loc.name!r} is {raw.dtype} {list(raw.shape)}, not bytes",
                                         self.store.join(self.path, loc.file))
        data = raw.numpy().tobytes()
        if loc.kind == "bytes":
            return data
        if loc.kind == "bytesio":
            return io.BytesIO(data)
        try:
            return values.decode(json.loads(data), lambda ref: self.stored(loc.file, ref))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CorruptCheckpointError(f"item {loc.name!r} does not decode ({e})",
                                         self.store.join(self.path, loc.file)) \
                from None

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
            full = self.store.join(self.path, file)
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
    """DCP's ``StorageReader`` of ours (public as ``lightning_ort_ckpt.dcp.OrtStorageReader``): reads only the items
    the load plan asks for, each tensor's checksum verified; non-tensor items are handed to the planner as the
    values they were (never through a pickle). ``doc``: the metadata document, when the caller read it already;
    ``store``: the store of ``path``, when the caller built it already (else one is built from ``storage_options``,
    once)."""

    def __init__(self, path: str | os.PathLike[str], *, storage_options: StorageOptions | None = None,
                 doc: dict[str, Any] | None = None, store: Store | None = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.stores = Stores(storage_options, store)  # a store per backend, kept from load to load
        self.doc = doc
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load: of ``checkpoint_id`` when given (DCP's ``load(..., checkpoint_id=)``), else of the same path."""
        if checkpoint_id and os.fspath(checkpoint_id) != self.path:
            self.path = os.fspath(checkpoint_id)
            self.doc = None
        self.metadata = None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata as DCP's ``Metadata``; ``rank=``: that rank's own, of a save without
        collectives (DCP asks for it when there is no global one)."""
        rank = kwargs.get("rank")
        doc = self.doc if self.doc is not None and rank is None else \
            read_metadata(self.path, self.stores.of(self.path), rank)
        if rank is None:
            self.doc = doc
        try:
            return _dcp_metadata.to_dcp(doc)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CorruptCheckpointError(f"damaged metadata: {e}", self.path) from None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.metadata is not None, "DCP sets the reader up before it reads"
        storage = self.metadata.storage_data
        items = sorted(plan.items, key=lambda i: (storage[i.storage_index].file, storage[i.storage_index].name))
        with ShardFiles(self.path, self.stores.of(self.path)) as files:
            for item in items:
                loc = storage[item.storage_index]
                if item.type == LoadItemType.BYTE_IO:
                    _deliver(planner, item, files.value(loc), self.path)
                    continue
                md = self.metadata.state_dict_metadata[item.storage_index.fqn]
                assert isinstance(md, TensorStorageMetadata), "DCP reads a tensor item into a tensor"
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
        """Whether ``checkpoint_id`` is a sharded checkpoint of ours (its metadata, or rank 0's, is there)."""
        path = os.fspath(checkpoint_id)
        with contextlib.suppress(Exception):
            store = store_for(path)
            return any(store.read_head(store.join(path, name), len(HEAD)) == HEAD
                       for name in (METADATA_NAME, rank_metadata_name(0)))
        return False



def _deliver(planner: LoadPlanner, item: ReadItem, value: Any, path: str) -> None:
    """Hand a non-tensor item to the planner as its ``load_bytes`` would after unpickling it: DCP's default planner
    (and its subclasses) get the value put in place; another planner, which only takes a pickle, is refused."""
    if not isinstance(planner, DefaultLoadPlanner):
        raise CorruptCheckpointError(f"{item.dest_index.fqn!r} is no tensor and the planner {type(planner).__name__} "
                                     "takes values only as pickles (load_bytes); this storage never unpickles: use "
                                     "DefaultLoadPlanner or a subclass of it", path)
    if not planner.flatten_state_dict:
        planner.state_dict[item.dest_index.fqn] = value
        return
    *parents, last = planner.mappings[item.dest_index.fqn]
    node: Any = planner.original_state_dict
    for key in parents:
        node = node[key]
    node[last] = value

