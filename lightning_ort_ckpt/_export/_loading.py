"""Loading outside a Trainer: the one line for scripts and notebooks.

Our checkpoints are ORT files (``ODTC``), not torch files, though they keep Lightning's ``.ckpt`` name: torch's
loader cannot read them. ``MyModel.load_from_checkpoint(path)`` reads them after
:func:`~lightning_ort_ckpt.enable_ort_loading` (a process-wide opt-in); without it, these two functions turn ORT
loading on for their own call only:

- :func:`load_from_checkpoint`: ``lightning_ort_ckpt.load_from_checkpoint(MyModel, path, **kwargs)`` is
  ``MyModel.load_from_checkpoint(path, **kwargs)`` for ORT files, sharded checkpoint folders and torch files alike;
- :func:`load`: the ``torch.load`` of our files, Lightning's checkpoint dict.

Why torch's own error cannot say this: it comes from ``torch.load``'s unpickler inside Lightning's loader, before
any code of ours runs. Changing it means replacing a torch or Lightning function in every process that imports the
package, and importing the package changes nothing for code that does not use it (README, "Usage").

Torch loads only when a function here reads a file: the CLI uses :func:`is_folder` and :func:`single_file` without it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, TypeVar

from ..errors import CheckpointError
from ..format._store import StorageOptions, Store, Stores

M = TypeVar("M")


def is_folder(path: str | os.PathLike[str], store: Store) -> bool:
    """A local directory, or a URL naming no file (perhaps a sharded checkpoint's folder), on its ``store``."""
    path = os.fspath(path)
    if store.local:
        return store.is_directory(path)
    return store.exists(path) and not store.read_head(path, 1)


@contextlib.contextmanager
def single_file(path: str | os.PathLike[str], stores: Stores | None = None) -> Iterator[str]:
    """``path``, or a sharded checkpoint folder consolidated into a temporary ORT file for the block (needs torch,
    which wrote it). A folder without its ``checkpoint.ort-meta``, or with a damaged one, is an error naming it.
    ``stores``: the caller's, which then has the store of what it yields too."""
    path, stores = os.fspath(path), stores if stores is not None else Stores()
    if not is_folder(path, stores.of(path)):
        yield path
        return
    from ._consolidate import single_file as consolidated
    from .._dcp._dcp_folder import read_metadata

    read_metadata(path, stores.of(path))
    with consolidated(path, stores) as single:
        yield single


def load(path: str | os.PathLike[str], map_location: Any = None,
         storage_options: StorageOptions | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dict of ``path``, as ``torch.load`` gives it for Lightning's own files: an ORT file
    (checksums verified), a sharded checkpoint folder, or a torch ``.ckpt`` (``weights_only=True``: no code in it
    runs); ``path`` may be an fsspec URL. ``map_location`` as ``torch.load``'s. A path where nothing is is our
    error saying so (not that a file is damaged)."""
    path, stores = os.fspath(path), Stores(storage_options)  # built here, once: every read below goes through it
    if not stores.of(path).exists(path):
        raise CheckpointError("no such file or folder: nothing to load", path)
    from .._restore._reading import is_ort_checkpoint, load_ort_for_lightning, map_location_of, read_any_checkpoint

    with single_file(path, stores) as single:
        if is_ort_checkpoint(single, stores.of(single)):
            return load_ort_for_lightning(single, map_location, stores.of(single))
        return map_location_of(read_any_checkpoint(single, stores.of(single)), map_location)


def load_from_checkpoint(cls: type[M], path: str | os.PathLike[str], **kwargs: Any) -> M:
    """``cls.load_from_checkpoint(path, **kwargs)`` (a ``LightningModule`` or ``LightningDataModule`` class) for
    any checkpoint: ORT file, sharded checkpoint folder, or torch ``.ckpt``. ORT loading is on for this call only."""
    from .._restore._reading import disable_ort_loading, enable_ort_loading

    enable_ort_loading()
    try:
        with single_file(path) as single:
            return cls.load_from_checkpoint(single, **kwargs)  # type: ignore[attr-defined]
    finally:
        disable_ort_loading()
