"""A sharded checkpoint folder as our DCP storage lays it out: the names of its files, which files are ours, its
metadata document read and checked, and the files of replaced saves removed after a commit.

The folder holds ``shard-<save id>-<rank>.odtc`` (one ODTC file per writing rank, a ``.data`` companion past 2 GiB)
and :data:`METADATA_NAME`, the JSON document (``_dcp_metadata``) written LAST, atomically, by the coordinator once
every rank's file is durable: a folder without it is not a checkpoint. A save without collectives writes one
metadata file per rank instead (:func:`rank_metadata_name`). Replacing a checkpoint writes the new shard files
beside the old ones under a new save id, then replaces the metadata file in one step (the store's commit: a rename
on a local disk, a completed single-object upload on S3/GCS/Azure); the old save's files go only then.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from . import _dcp_metadata
from ._dcp_metadata import SHARD
from ..errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from ..format._atomic import FOLDER_COMMIT_NAME
from ..format._store import Store, store_for

__all__ = ["HEAD", "METADATA_NAME", "CommitUnknownError", "commit_unknown", "is_ours", "is_sharded_checkpoint",
           "rank_metadata_name", "read_metadata", "remove_other_saves", "shard_name"]

METADATA_NAME = FOLDER_COMMIT_NAME
"""The metadata file inside a sharded checkpoint directory; its presence is what makes the directory a checkpoint
(the stores, which delete it first when they remove a folder, know it by the format layer's name)."""

_MAX_METADATA_BYTES = 1 << 30


def rank_metadata_name(rank: int) -> str:
    """The metadata file of one rank in a save without collectives (``use_collectives=False``): each rank describes
    only its own shard file, as DCP's ``__<rank>.metadata``; such a folder loads at the same world size only."""
    return f"rank-{rank:05d}.ort-meta"


def shard_name(save_id: str, rank: int) -> str:
    """The shard file of ``rank`` in the save ``save_id``."""
    return f"shard-{save_id}-{rank:05d}.odtc"


HEAD = b'{"format":"' + _dcp_metadata.FORMAT.encode()
"""How our metadata files begin (``_dcp_metadata.encoded`` writes the format first)."""


class CommitUnknownError(CheckpointSaveError):
    """Writing the metadata failed in a way that may still have stored it (an upload whose answer was lost): the
    shard files it would name are kept (the next save of the path removes them if it never landed)."""


def is_ours(file: str) -> bool:
    """Whether ``file`` is one a sharded checkpoint of ours holds: a shard file or a metadata file."""
    base = file.replace("\\", "/").rsplit("/", 1)[-1]
    return bool(SHARD.fullmatch(base)) or base.endswith(".ort-meta")


def commit_unknown(error: BaseException) -> bool:
    if isinstance(error, CommitUnknownError):
        return True
    if isinstance(error, CheckpointException):
        return any(isinstance(f[0] if isinstance(f, tuple) else f, CommitUnknownError)
                   for f in error.failures.values())
    return False


def remove_other_saves(store: Store, path: str, keep: set[str], rank: int | None) -> None:
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


def read_metadata(path: str, store: Store, rank: int | None = None) -> dict[str, Any]:
    """The checked metadata document of the sharded checkpoint ``path`` on ``store`` (``rank``: that rank's own, of
    a save without collectives); :class:`CorruptCheckpointError` naming the file when it is missing (not a committed
    checkpoint) or damaged."""
    name = METADATA_NAME if rank is None else rank_metadata_name(rank)
    meta = store.join(path, name)
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


def is_sharded_checkpoint(path: str, store: Store | None = None) -> bool:
    """True for a COMMITTED sharded checkpoint directory of ours (its metadata file exists and parses); False for a
    file, a missing path, or a half-written directory."""
    try:
        read_metadata(os.fspath(path), store if store is not None else store_for(os.fspath(path)))
    except (CheckpointError, OSError, ValueError):
        return False
    return True

