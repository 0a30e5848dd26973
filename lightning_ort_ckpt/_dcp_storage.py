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
import io
import json
import os
import secrets
import warnings
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint import (DefaultLoadPlanner, DefaultSavePlanner, LoadPlan, LoadPlanner, Metadata,
                                          SavePlan, SavePlanner, StorageReader, StorageWriter)
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult

from . import _dcp_metadata
from ._dcp_staging import ShardStager, prepare_tree, stage_tree
from ._dcp_metadata import SHARD, Location, dtype_of
from ._translation import values
from .errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from .format import CheckpointContents, CheckpointReader, TensorInfo, save_checkpoint
from .format._atomic import FOLDER_COMMIT_NAME
from .format._store import StorageOptions, Store, store_for

__all__ = ["METADATA_NAME", "OrtStorageReader", "OrtStorageWriter", "ShardFiles", "dtype_of", "flatten",
           "is_sharded_checkpoint", "load_sharded", "read_metadata", "save_flat", "save_sharded"]

METADATA_NAME = FOLDER_COMMIT_NAME
"""The metadata file inside a sharded checkpoint directory; its presence is what makes the directory a checkpoint
(the stores, which delete it first when they remove a folder, know it by the format layer's name)."""

_MAX_METADATA_BYTES = 1 << 30


def rank_metadata_name(rank: int) -> str:
    """The metadata file of one rank in a save without collectives (``use_collectives=False``): each rank describes
    only its own shard file, as DCP's ``__<rank>.metadata``; such a folder loads at the same world size only."""
    return f"rank-{rank:05d}.ort-meta"


def join(path: str, name: str) -> str:
    """``name`` inside the directory ``path`` (a local path or a URL)."""
    return store_for(path).join(path, name)


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


class CommitUnknownError(CheckpointSaveError):
    """Writing the metadata failed in a way that may still have stored it (an upload whose answer was lost): the
    shard files it would name are kept (the next save of the path removes them if it never landed)."""


# -- saving ---------------------------------------------------------------------------------------------------------
class OrtStorageWriter(StorageWriter, AsyncStager):
    """DCP's ``StorageWriter`` of ours (public as ``lightning_ort_ckpt.dcp.OrtStorageWriter``): each rank writes one
    ODTC file of its items (tensor chunks, and each non-tensor item as a uint8 tensor: no pickle), with a checksum
    per tensor; the coordinator writes the JSON metadata last, atomically, then removes the files of the save it
    replaced. ``overwrite=False`` refuses a path that holds a checkpoint; ``thread_count`` is accepted for
    ``FileSystemWriter``'s signature (one file per rank, streamed once: see docs/dcp.md). ``tree``: for
    :func:`save_sharded`, the encoded tree of the save (the coordinator's is kept).

    As DCP's stager (``dcp.async_save(state, storage_writer=writer)``): the state is copied into CPU memory the
    writer keeps from save to save (allocated by the first, or ahead of it by :meth:`allocate_staging`, reused by the
    next ones; :meth:`close` frees it), and ``async_save`` returns once that copy is done."""

    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike[str], *, storage_options: StorageOptions | None = None,
                 overwrite: bool = True, thread_count: int = 1, tree: Any = None) -> None:
        super().__init__()
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be a positive int, not {thread_count!r}")
        self.storage_options = storage_options
        self.overwrite = overwrite
        self.thread_count = thread_count
        self.tree = tree
        self.is_coordinator = False
        self.rank = 0
        self.use_collectives = True
        self.path = ""
        self.store: Store
        self.reset(path)
        self._stager = ShardStager()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """DCP's ``AsyncStager.stage``: a copy of ``state_dict`` that training cannot change, in reused memory."""
        return stage_tree(self._stager, state_dict)

    def allocate_staging(self, state_dict: dict[str, Any]) -> None:
        """Allocate, on a thread of its own, the staging memory of ``dcp.async_save(state_dict, storage_writer=self)``
        (a state of the same keys and shapes), so that the first one copies into memory that is there already."""
        prepare_tree(self._stager, state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once its copies are complete."""

    def close(self) -> None:
        """Free the staging memory (after the last ``async_save`` is written)."""
        self._stager.close()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save: to ``checkpoint_id`` when given (DCP's ``save(..., checkpoint_id=)``), else to the same path."""
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
            self.store = store_for(self.path, self.storage_options)
        self.save_id = secrets.token_hex(8)
        self.files: list[str] = []
        self.written: str | None = None
        self.committed = False
        self.existed = True

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        self.use_collectives = kwargs.get("use_collectives", True)
        self.existed = self.store.exists(self.path)  # before any rank of this save wrote into it

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.overwrite and any(self.store.exists(join(self.path, name))
                                      for name in (METADATA_NAME, rank_metadata_name(self.rank))):
            raise CheckpointSaveError("a checkpoint exists here already and the writer has overwrite=False", self.path)
        if not self.use_collectives:
            if self.store.exists(join(self.path, METADATA_NAME)):
                raise CheckpointSaveError(f"a save without collectives (use_collectives=False) would leave this "
                                          f"checkpoint's {METADATA_NAME} naming shards of another save; save to "
                                          "another path or remove it", self.path)
            self.files = [self._name(self.rank)]
            return replace(plan, storage_data=self.files[0])
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: this save's id names every rank's file (its plan carries the name to the rank)."""
        if not self.use_collectives:
            return plans
        self.files = [self._name(rank) for rank in range(len(plans))]
        return [replace(plan, storage_data=name) for plan, name in zip(plans, self.files)]

    def _name(self, rank: int) -> str:
        return f"shard-{self.save_id}-{rank:05d}.odtc"

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's items, streamed from their own memory into its file (durable when this returns)."""
        name = plan.storage_data
        contents = CheckpointContents()
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                kind, size = self._stage_value(item, planner, contents)
                loc = Location(name, f"{item.index.fqn}#", kind)
            else:
                tensor = planner.resolve_data(item)
                assert isinstance(tensor, torch.Tensor), "DCP resolves a tensor item to a tensor"
                loc = Location(name, f"{item.index.fqn}@{','.join(map(str, item.index.offset or ()))}")
                contents.frozen[loc.name] = tensor
                size = tensor.numel() * tensor.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=loc))
        self.written = join(self.path, name)
        save_checkpoint(contents, self.written, store=self.store)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _stage_value(self, item: WriteItem, planner: SavePlanner, contents: CheckpointContents) -> tuple[str, int]:
        """A non-tensor item as a uint8 tensor ``<fqn>#`` of ``contents`` (its nested tensors beside it, ``<fqn>#<n>``):
        its kind and size. The object itself, never DCP's pickle of it (the default planner's ``resolve_data``)."""
        lookup = getattr(planner, "lookup_object", None)
        if lookup is None:
            raise CheckpointSaveError(f"{item.index.fqn!r} is no tensor and the planner {type(planner).__name__} "
                                      "cannot hand over the object itself (lookup_object); the writer stores values "
                                      "without pickle and needs it", self.path)
        value = lookup(item.index)
        key = f"{item.index.fqn}#"
        if isinstance(value, (bytes, bytearray, io.BytesIO)):
            kind = "bytesio" if isinstance(value, io.BytesIO) else "bytes"
            raw = value.getvalue() if isinstance(value, io.BytesIO) else bytes(value)
        else:
            kind = "value"

            def sink(where: tuple[str, ...], tensor: torch.Tensor) -> str:
                name = f"{key}{len(contents.frozen)}"
                contents.frozen[name] = tensor.detach().cpu().contiguous()
                return name

            raw = json.dumps(values.encode(value, sink, (item.index.fqn,)), separators=(",", ":"),
                             allow_nan=False).encode()
        contents.frozen[key] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
            torch.empty(0, dtype=torch.uint8)
        return kind, len(raw)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator (on each rank without collectives), after every rank's file is durable: the metadata
        file, then the replaced save's files go. A write of the metadata that fails is read back: if it landed, the
        save is committed; if that cannot be told, :class:`CommitUnknownError` (the shards stay)."""
        where = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = metadata.storage_meta or self.storage_meta()
        data = _dcp_metadata.encoded(_dcp_metadata.document(metadata, where, self.files, self.tree))
        name = METADATA_NAME if self.use_collectives else rank_metadata_name(self.rank)
        meta = join(self.path, name)
        try:
            with self.store.writing(meta, with_data=False, required_bytes=len(data)) as files:
                files.main.write(data)
        except (OSError, CheckpointError) as e:
            if not self._landed(meta, data):
                raise CommitUnknownError(f"cannot write {name} ({getattr(e, 'strerror', None) or e}); it may have "
                                         "been stored all the same, so this save's shard files are kept (the next "
                                         "save of this path removes them)", self.path) from e
        self.committed = True
        _remove_other_saves(self.store, self.path, set(self.files), None if self.use_collectives else self.rank)

    def _landed(self, meta: str, data: bytes) -> bool:
        """Whether ``meta`` holds exactly ``data`` (this save's metadata: its save id names its files)."""
        with contextlib.suppress(Exception):
            with self.store.fetched(meta) as local, open(local, "rb") as f:
                return f.read(len(data) + 1) == data
        return False

    def discard(self, error: BaseException) -> None:
        """After a failed save (``error``: what the save raised): remove this rank's file and, when this save made
        the folder, the folder; unless the save was committed after all, or its metadata may have been stored."""
        if self.committed or _commit_unknown(error):
            return
        with contextlib.suppress(Exception):
            if self.written is not None and self.store.exists(self.written):
                self.store.remove(self.written)
        with contextlib.suppress(Exception):
            if not self.existed and self.store.exists(self.path):
                self.store.remove(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` can hold a checkpoint of ours: a path that does not exist yet, an empty folder,
        or a folder of ours; not a file, nor another writer's checkpoint folder (DCP's ``.metadata``)."""
        path = os.fspath(checkpoint_id)
        try:
            store = store_for(path)
            if not store.exists(path):
                return True
            if store.read_head(path, 1) or store.exists(join(path, ".metadata")):
                return False  # a file, or DCP's own checkpoint
            return all(_ours(name) for name in store.list_files(path, recursive=False))
        except Exception:  # noqa: BLE001 - a path we cannot look at is none we can tell is ours
            return False


def _ours(file: str) -> bool:
    """Whether ``file`` is one a sharded checkpoint of ours holds: a shard file or a metadata file."""
    base = file.replace("\\", "/").rsplit("/", 1)[-1]
    return bool(SHARD.fullmatch(base)) or base.endswith(".ort-meta")


def _commit_unknown(error: BaseException) -> bool:
    if isinstance(error, CommitUnknownError):
        return True
    if isinstance(error, CheckpointException):
        return any(isinstance(f[0] if isinstance(f, tuple) else f, CommitUnknownError)
                   for f in error.failures.values())
    return False


def _remove_other_saves(store: Store, path: str, keep: set[str], rank: int | None) -> None:
    """Best effort: the shard files of earlier (replaced or failed) saves of this directory (of this ``rank`` only,
    for a save without collectives, whose other ranks are writing theirs). The new checkpoint is committed already;
    a file left here is only space, removed by the next save of this path."""
    with contextlib.suppress(Exception):
        for file in store.list_files(path, recursive=False):
            base = file.replace("\\", "/").rsplit("/", 1)[-1]
            if (SHARD.fullmatch(base) and base not in keep
                    and (rank is None or base.endswith(f"-{rank:05d}.odtc"))):
                with contextlib.suppress(Exception):
                    store.remove(file)


def save_sharded(state: dict[str, Any], path: str, *, storage_options: dict[str, Any] | None = None,
                 process_group: Any = None) -> None:
    """Every rank calls it with its own state (leaves: ``torch.Tensor``, DTensor, or any value ``_translation.values``
    encodes; nested dicts and lists as in Lightning checkpoint dicts and optimizer state dicts). DCP plans (replicated
    tensors saved once), each rank writes its shards, the coordinator (rank 0) writes the metadata last: the directory
    is a checkpoint only once that file exists. Non-tensor leaves are taken from rank 0. Works without a process group
    (one process). Raises :class:`CheckpointSaveError` naming the path on failure, leaving the path as it was (no
    folder where there was none); an existing checkpoint of the same path is replaced only once the new one is
    complete."""
    path = os.fspath(path)
    tree, flat = flatten(state, path)
    save_flat(tree, flat, path, storage_options=storage_options, process_group=process_group)


def flatten(state: dict[str, Any], path: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """What :func:`save_sharded` saves of ``state``: its tree encoded (every non-tensor value as it is now) and its
    tensors by DCP key; :func:`save_flat` writes them (an asynchronous save stages the tensors in between)."""
    return _flatten(state, os.fspath(path), CheckpointSaveError)


def save_flat(tree: Any, flat: dict[str, torch.Tensor], path: str, *, storage_options: dict[str, Any] | None = None,
              process_group: Any = None) -> None:
    """:func:`save_sharded` of what :func:`flatten` gave."""
    writer = OrtStorageWriter(path, storage_options=storage_options, tree=tree)
    try:
        with _quiet():
            dcp_save(flat, storage_writer=writer, planner=DefaultSavePlanner(flatten_state_dict=False),
                     process_group=process_group, no_dist=_no_dist())
    except CheckpointException as e:
        writer.discard(e)
        raise _reported(e, path, CheckpointSaveError, "sharded save failed") from None
    except CheckpointError as e:
        writer.discard(e)
        raise
    except Exception as e:
        writer.discard(e)
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
def read_metadata(path: str, storage_options: StorageOptions | None = None, rank: int | None = None) -> dict[str, Any]:
    """The checked metadata document of the sharded checkpoint ``path`` (``rank``: that rank's own, of a save
    without collectives); :class:`CorruptCheckpointError` naming the file when it is missing (not a committed
    checkpoint) or damaged."""
    store = store_for(path, storage_options)
    name = METADATA_NAME if rank is None else rank_metadata_name(rank)
    meta = join(path, name)
    if not store.exists(meta):
        raise CorruptCheckpointError(f"not a sharded checkpoint: it has no {name} (a save that did not "
                                     "finish, or another kind of directory)", path)
    try:
        with store.fetched(meta) as local, open(local, "rb") as f:
            data = f.read(_MAX_METADATA_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read the metadata file ({e.strerror or e})", meta) from None
    try:
        if len(data) > _MAX_METADATA_BYTES:
            raise ValueError("it is larger than 1 GiB")
        doc = _dcp_metadata.parse(data)
        _dcp_metadata.to_dcp(doc)  # every value in it decodes
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"damaged metadata: {e}", meta) from None
    return doc


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
        reader, info = self._info(file, name)
        if info.dtype.to_torch() != dtype or info.shape != tuple(sizes):
            raise CorruptCheckpointError(f"tensor {name!r} is {info.dtype.name} {list(info.shape)}, but "
                                         f"{METADATA_NAME} says {dtype} {list(sizes)}", join(self.path, file))
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
                                         join(self.path, file))
        return reader, info

    def _read(self, file: str, reader: CheckpointReader, info: TensorInfo, into: torch.Tensor | None) -> torch.Tensor:
        try:
            if into is not None:
                reader.read_bytes(info, into.reshape(-1).view(torch.uint8).numpy())
                return into
            return _as_torch(reader.read_bytes(info), info)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(str(e).removeprefix(f"{reader.path}: "), join(self.path, file)) from None

    def value(self, loc: Location) -> Any:
        """A non-tensor item: ``bytes``, an ``io.BytesIO`` (at position 0), or the value it was."""
        raw = self.stored(loc.file, loc.name)
        if raw.dtype != torch.uint8 or raw.dim() != 1:
            raise CorruptCheckpointError(f"item {loc.name!r} is {raw.dtype} {list(raw.shape)}, not bytes",
                                         join(self.path, loc.file))
        data = raw.numpy().tobytes()
        if loc.kind == "bytes":
            return data
        if loc.kind == "bytesio":
            return io.BytesIO(data)
        try:
            return values.decode(json.loads(data), lambda ref: self.stored(loc.file, ref))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CorruptCheckpointError(f"item {loc.name!r} does not decode ({e})", join(self.path, loc.file)) \
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
    """DCP's ``StorageReader`` of ours (public as ``lightning_ort_ckpt.dcp.OrtStorageReader``): reads only the items
    the load plan asks for, each tensor's checksum verified; non-tensor items are handed to the planner as the
    values they were (never through a pickle). ``doc``: the metadata document, when the caller read it already."""

    def __init__(self, path: str | os.PathLike[str], *, storage_options: StorageOptions | None = None,
                 doc: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.storage_options = storage_options
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
            read_metadata(self.path, self.storage_options, rank)
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
        with ShardFiles(self.path, self.storage_options) as files:
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
            return any(store.read_head(join(path, name), len(_HEAD)) == _HEAD
                       for name in (METADATA_NAME, rank_metadata_name(0)))
        return False


_HEAD = b'{"format":"' + _dcp_metadata.FORMAT.encode()
"""How our metadata files begin (``_dcp_metadata.encoded`` writes the format first)."""


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
            dcp_load({**asked, **whole}, storage_reader=OrtStorageReader(path, storage_options=storage_options, doc=doc),
                     planner=DefaultLoadPlanner(flatten_state_dict=False), process_group=process_group,
                     no_dist=_no_dist())
    except CheckpointException as e:
        raise _reported(e, path, CorruptCheckpointError, "sharded load failed") from None
    tensors = {**whole, **asked}
    try:
        # a tensor not read (sharded, not asked for) decodes as None
        return values.decode(doc["tree"], lambda key: cast(torch.Tensor, tensors.get(key)))
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

