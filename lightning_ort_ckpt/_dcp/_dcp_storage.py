"""Sharded checkpoints of our Lightning integration, under ``torch.distributed.checkpoint`` (DCP).

DCP plans (which rank saves which chunk of which tensor: replicated tensors once, a DTensor's shards by their
owners; on load, which saved chunks fill which part of each rank's tensors, at any world size); our storage
(``_dcp_writer``, ``_dcp_reader``) stores, in the folder ``_dcp_folder`` describes. Here: :func:`save_sharded` and
:func:`load_sharded`, which save and load a Lightning checkpoint's whole tree: its tensors through DCP, its
non-tensor values encoded by ``_translation.values`` into the metadata document (DCP sees tensors only). A save
that fails removes what it wrote.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException

from ._dcp_folder import METADATA_NAME, is_sharded_checkpoint, read_metadata
from ._dcp_metadata import dtype_of
from ._dcp_reader import OrtStorageReader, ShardFiles
from ._dcp_writer import OrtStorageWriter, tree_writer
from .._translation import values
from ..errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from ..format._store import Store, store_for

__all__ = ["METADATA_NAME", "OrtStorageReader", "OrtStorageWriter", "ShardFiles", "dtype_of", "flatten",
           "is_sharded_checkpoint", "load_sharded", "read_metadata", "save_flat", "save_sharded"]


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


def save_sharded(state: dict[str, Any], path: str, *, store: Store | None = None, process_group: Any = None) -> None:
    """Every rank calls it with its own state (leaves: ``torch.Tensor``, DTensor, or any value ``_translation.values``
    encodes; nested dicts and lists as in Lightning checkpoint dicts and optimizer state dicts). DCP plans (replicated
    tensors saved once), each rank writes its shards, the coordinator (rank 0) writes the metadata last: the directory
    is a checkpoint only once that file exists. Non-tensor leaves are taken from rank 0. Works without a process group
    (one process). Raises :class:`CheckpointSaveError` naming the path on failure, leaving the path as it was (no
    folder where there was none); an existing checkpoint of the same path is replaced only once the new one is
    complete. ``store``: the store of ``path`` (None: the one :func:`~.format._store.store_for` gives)."""
    path = os.fspath(path)
    tree, flat = flatten(state, path)
    save_flat(tree, flat, path, store=store if store is not None else store_for(path), process_group=process_group)


def flatten(state: dict[str, Any], path: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """What :func:`save_sharded` saves of ``state``: its tree encoded (every non-tensor value as it is now) and its
    tensors by DCP key; :func:`save_flat` writes them (an asynchronous save stages the tensors in between)."""
    return _flatten(state, os.fspath(path), CheckpointSaveError)


def save_flat(tree: Any, flat: dict[str, torch.Tensor], path: str, *, store: Store, process_group: Any = None) -> None:
    """:func:`save_sharded` of what :func:`flatten` gave, on ``store``."""
    writer = tree_writer(path, tree, store)
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


def load_sharded(state: dict[str, Any], path: str, *, store: Store | None = None, process_group: Any = None,
                 others: bool = True) -> dict[str, Any]:
    """Every rank calls it. Fills every tensor leaf of ``state`` (Tensor or DTensor) IN PLACE from the checkpoint,
    resharded by DCP's planner (another world size works), and returns the whole saved tree with the tensors of
    ``state`` in their places and every saved non-tensor value decoded (keys absent from ``state`` included, so the
    caller gets loops, callbacks, hyper-parameters). Of the tensors ``state`` does not ask for, those saved whole
    (one chunk: a callback's score, a replicated buffer) are read into the returned tree; sharded ones are not read
    and come back as None; with ``others=False`` none of them is read (all None: the saved values alone, for a
    caller that looks at them before it asks for tensors). Raises :class:`CorruptCheckpointError` naming the file on
    damage (checksums are verified)."""
    path = os.fspath(path)
    store = store if store is not None else store_for(path)
    doc = read_metadata(path, store)
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
            dcp_load({**asked, **whole}, storage_reader=OrtStorageReader(path, store=store, doc=doc),
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
                                     store.join(path, METADATA_NAME)) from None

