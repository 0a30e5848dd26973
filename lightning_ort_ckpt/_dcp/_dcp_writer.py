"""Our ``torch.distributed.checkpoint`` ``StorageWriter`` (public as ``lightning_ort_ckpt.dcp.OrtStorageWriter``):
each rank streams its items into one ODTC file of the folder (``_dcp_folder``), the coordinator commits the JSON
metadata last. Non-tensor items are stored as the objects themselves (uint8 tensors and JSON), never as DCP's
pickles."""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
from dataclasses import replace
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import Metadata, SavePlan, SavePlanner, StorageWriter
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult

from . import _dcp_metadata
from ._dcp_folder import (METADATA_NAME, CommitUnknownError, commit_unknown, is_ours, rank_metadata_name,
                          remove_other_saves, shard_name)
from ._dcp_metadata import Location
from ._dcp_staging import ShardStager, prepare_tree, stage_tree
from .._translation import values
from ..errors import CheckpointError, CheckpointSaveError
from ..format import CheckpointContents, save_checkpoint
from ..format._store import StorageOptions, Store, Stores, store_for

__all__ = ["OrtStorageWriter"]


class OrtStorageWriter(StorageWriter, AsyncStager):
    """DCP's ``StorageWriter`` of ours (public as ``lightning_ort_ckpt.dcp.OrtStorageWriter``): each rank writes one
    ODTC file of its items (tensor chunks, and each non-tensor item as a uint8 tensor: no pickle), with a checksum
    per tensor; the coordinator writes the JSON metadata last, atomically, then removes the files of the save it
    replaced. ``overwrite=False`` refuses a path that holds a checkpoint; ``thread_count`` is accepted for
    ``FileSystemWriter``'s signature (one file per rank, streamed once: see docs/dcp.md). ``store``: the store of
    ``path`` where the caller built it already (else one is built from ``storage_options``, once).

    As DCP's stager (``dcp.async_save(state, storage_writer=writer)``): the state is copied into CPU memory the
    writer keeps from save to save (allocated by the first, or ahead of it by :meth:`allocate_staging`, reused by the
    next ones; :meth:`close` frees it), and ``async_save`` returns once that copy is done."""

    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike[str], *, storage_options: StorageOptions | None = None,
                 overwrite: bool = True, thread_count: int = 1, store: Store | None = None) -> None:
        super().__init__()
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be a positive int, not {thread_count!r}")
        self.stores = Stores(storage_options, store)  # a store per backend, kept from save to save
        self.overwrite = overwrite
        self.thread_count = thread_count
        self._tree: Any = None  # save_sharded's encoded values (:func:`tree_writer`); DCP users give none
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
            self.store = self.stores.of(self.path)
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
        if not self.overwrite and any(self.store.exists(self.store.join(self.path, name))
                                      for name in (METADATA_NAME, rank_metadata_name(self.rank))):
            raise CheckpointSaveError("Checkpoint already exists here and the writer has overwrite=False", self.path)
        if not self.use_collectives:
            if self.store.exists(self.store.join(self.path, METADATA_NAME)):
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
        return shard_name(self.save_id, rank)

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
        self.written = self.store.join(self.path, name)
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
        data = _dcp_metadata.encoded(_dcp_metadata.document(metadata, where, self.files, self._tree))
        name = METADATA_NAME if self.use_collectives else rank_metadata_name(self.rank)
        meta = self.store.join(self.path, name)
        try:
            with self.store.writing(meta, with_data=False, required_bytes=len(data)) as files:
                files.main.write(data)
        except (OSError, CheckpointError) as e:
            if not self._landed(meta, data):
                raise CommitUnknownError(f"cannot write {name} ({getattr(e, 'strerror', None) or e}); it may have "
                                         "been stored all the same, so this save's shard files are kept (the next "
                                         "save of this path removes them)", self.path) from e
        self.committed = True
        remove_other_saves(self.store, self.path, set(self.files), None if self.use_collectives else self.rank)

    def _landed(self, meta: str, data: bytes) -> bool:
        """Whether ``meta`` holds exactly ``data`` (this save's metadata: its save id names its files)."""
        with contextlib.suppress(Exception):
            with self.store.fetched(meta) as local, open(local, "rb") as f:
                return f.read(len(data) + 1) == data
        return False

    def discard(self, error: BaseException) -> None:
        """After a failed save (``error``: what the save raised): remove this rank's file and, when this save made
        the folder, the folder; unless the save was committed after all, or its metadata may have been stored."""
        if self.committed or commit_unknown(error):
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
            if store.read_head(path, 1) or store.exists(store.join(path, ".metadata")):
                return False  # a file, or DCP's own checkpoint
            return all(is_ours(name) for name in store.list_files(path, recursive=False))
        except Exception:  # noqa: BLE001 - a path we cannot look at is none we can tell is ours
            return False


def tree_writer(path: str, tree: Any, store: Store) -> OrtStorageWriter:
    """The writer of ``_dcp_storage.save_flat``, on ``store`` (its caller's): its metadata also holds ``tree``, the
    save's values encoded (the coordinator's is kept). Not a parameter of :class:`OrtStorageWriter`: DCP users never
    give one."""
    writer = OrtStorageWriter(path, store=store)
    writer._tree = tree
    return writer
