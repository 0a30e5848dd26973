"""Where checkpoint files live: the one interface every layer above reads and writes checkpoint files through.

A :class:`Store` is built once per location (a plugin keeps its own in :class:`Stores` for its lifetime; a call
builds one) by :func:`store_for` and passed down, never rebuilt from ``storage_options`` below: each backend
class says which paths are its own (:meth:`Backend.handles`, as ``torch.distributed.checkpoint``'s
``validate_checkpoint_id``) and :func:`store_for` takes the first of :data:`BACKENDS` that does. A local path (no
``protocol://``, or a ``file://`` URL: :func:`local_path`) is :class:`~._local_store.LocalStore`'s (the journaled
atomic commit, durable directories, writer locks, hard and symbolic links); any other fsspec URL (S3, GCS, Azure,
``memory://``) is :class:`~._fsspec_store.FsspecStore`'s, which swaps the file system and keeps everything else. A
new backend is one more class with these methods, put first by :func:`register`. Questions about paths (how to join,
compare or test them) are the store's too, so no layer above asks "local or remote?".

The save pipeline is the same for every store (``_writer``): plan every byte, open the new files with
:meth:`Store.writing`, stream the tensors into them, and leave the block: the store commits (atomically, or not at
all). A store that cannot write back into a file it streamed (an upload) says so with ``rewritable = False``; the
writer then hashes the tensors before streaming instead of filling the checksum record afterwards.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from collections.abc import Callable
from typing import Any, Protocol

from ._atomic import SaveFiles, keep_spares as _keep_local_spares
from ._fsspec_store import FsspecStore
from ._local_store import LocalStore
from ._urls import is_remote, local_path, strip_protocol

__all__ = ["BACKENDS", "Backend", "StorageOptions", "Store", "Stores", "is_remote", "local_path", "register",
           "keep_spares", "store_for", "strip_protocol", "wait_for_cleanup"]

StorageOptions = dict[str, Any]
"""fsspec's keyword arguments for the file system of a URL (credentials, ``client_kwargs``, s3fs's
``default_block_size``...)."""


class Store(Protocol):
    """Stores checkpoint files (each with its ``.data`` companion) by path or URL."""

    rewritable: bool
    """Whether the writer may write into a new file after streaming it (the checksum record); else it hashes first."""
    links: bool
    """Whether a new ``.data`` can be a hard link to an existing one (frozen sharing: ``link_data``)."""
    local: bool
    """Whether its paths are the local file system's: :meth:`fetched` hands back the file itself (no download)."""

    def in_memory(self, path: str) -> bool:
        """Whether ``path`` is on a memory file system (tmpfs, ramfs): a write there is a copy into memory that no
        disk slows down or throttles."""
        ...

    def writing(self, path: str, *, with_data: bool, required_bytes: int,
                link_data: Callable[[str], bool] | None = None) -> AbstractContextManager[SaveFiles]:
        """New files to stream into; on a clean exit they replace ``path`` (and its ``.data``) whole, ``.data``
        first; on an exception nothing changes. ``link_data``: called with the new ``.data``'s temporary name, it
        makes that a link to an existing file instead (the sharing plan's ``link``), where the store can and it
        returns True (``SaveFiles.linked``)."""
        ...

    def fetched(self, path: str) -> AbstractContextManager[str]:
        """A local path holding ``path`` and its ``.data`` for the length of the block."""
        ...

    def read_head(self, path: str, size: int) -> bytes:
        """The first ``size`` bytes of a file; b"" when it cannot be read (missing, a directory, no access). A
        FIFO, socket or device raises our error (:meth:`check_file`): it is never opened to wait on."""
        ...

    def check_file(self, path: str) -> None:
        """Raise our error (:class:`~lightning_ort_ckpt.errors.CheckpointError`) naming ``path`` when it exists but
        cannot be read as a file: a FIFO, socket or device (opening it could block forever), a symlink loop, no
        access. Nothing for a missing path or a folder (the caller words those)."""
        ...

    def exists(self, path: str) -> bool: ...

    def is_directory(self, path: str) -> bool:
        """Whether ``path`` is a folder (a sharded checkpoint is one)."""
        ...

    def modified(self, path: str) -> float:
        """Last modification time (seconds since the epoch); ``-inf`` when unknown."""
        ...

    def join(self, directory: str, name: str) -> str:
        """``name`` inside ``directory``, spelled as the store spells paths."""
        ...

    def absolute(self, path: str) -> str:
        """The one spelling of ``path`` to compare paths by (a local path made absolute; a URL as it is)."""
        ...

    def list_files(self, directory: str, recursive: bool) -> list[str]:
        """The visible files in ``directory`` (and below it when ``recursive``; hidden names and folders are left
        out), spelled as ``directory`` is; [] when it does not exist."""
        ...

    def list_folders(self, directory: str, recursive: bool) -> list[str]:
        """The visible folders in ``directory`` (and below it when ``recursive``), spelled as ``directory`` is; []
        when it does not exist. A sharded checkpoint is a folder."""
        ...

    def remove(self, path: str) -> None:
        """Delete a checkpoint and its ``.data``: the checkpoint first, so no reader finds one without its data; a
        checkpoint folder goes whole (no hidden copy stays behind), its commit file first."""
        ...

    def link_or_copy(self, target: str, linkpath: str) -> None:
        """``linkpath`` (and its ``.data``) becomes ``target``: a symbolic link where the store has them, else a
        copy, whole or not at all."""
        ...

    def link_target(self, path: str) -> str | None:
        """Where the link ``path`` points (a path), or None when it is no link."""
        ...

    def size(self, path: str) -> int:
        """The bytes of a file and its ``.data``, or of everything in a folder; 0 when it is gone."""
        ...

    def contains(self, directory: str, path: str) -> bool:
        """Whether ``path`` lies in ``directory`` or below it, after ``..`` and links in its folders are resolved
        (the name itself is never followed)."""
        ...

    def temp_name(self, path: str) -> str:
        """A hidden name beside ``path`` for a file of this process's own (a background copy): what a killed
        process left under it, the next save in the folder sweeps."""
        ...


class Backend(Protocol):
    """A store class: it says which paths are its own, and makes a store for them."""

    def __call__(self, storage_options: StorageOptions | None = None) -> Store: ...

    def handles(self, path: str | os.PathLike[str] | None) -> bool:
        """Whether paths like ``path`` are this backend's (a classmethod; ``None``: no path, the local disk)."""
        ...

    def wait_for_cleanup(self) -> None:
        """Wait until deletions this backend left to a background thread are done (a classmethod)."""
        ...


BACKENDS: tuple[Backend, ...] = (FsspecStore, LocalStore)
"""The store classes :func:`store_for` asks, in order; the local disk last, as it takes any path no other does."""


def register(backend: Backend) -> None:
    """Put ``backend`` ahead of the others: the paths it :meth:`handles <Backend.handles>` are its from now on."""
    global BACKENDS
    BACKENDS = (backend, *(b for b in BACKENDS if b is not backend))


def store_for(path: str | os.PathLike[str] | None, storage_options: StorageOptions | None = None) -> Store:
    """The store of ``path``, built with ``storage_options``: the first of :data:`BACKENDS` that handles it."""
    backend = next(b for b in BACKENDS if b.handles(path))
    return backend(storage_options)


class Stores:
    """The stores of one owner's locations (a plugin's, for its lifetime), each built at its first path and kept: a
    store serves every path of its backend with the same options, so a save, a removal and a resume share it."""

    def __init__(self, storage_options: StorageOptions | None = None, held: Store | None = None) -> None:
        """``held``: a store built already (by the caller that knew the location first), kept for its backend."""
        self.storage_options = storage_options
        self._built: dict[Any, Store] = {type(held): held} if held is not None else {}

    def of(self, path: str | os.PathLike[str] | None, extra: StorageOptions | None = None) -> Store:
        """The store of ``path``; with ``extra`` options (merged over the owner's), one of its own, for one call."""
        backend = next(b for b in BACKENDS if b.handles(path))
        if extra:
            return backend({**(self.storage_options or {}), **extra})
        if backend not in self._built:
            self._built[backend] = backend(self.storage_options)
        return self._built[backend]


def keep_spares() -> Callable[[], None]:
    """Until the returned function is called (a plugin's teardown), the local disk's saves may write over files
    the saves before them retired (``_atomic._cleanup``: spares); a save no one keeps them for leaves none."""
    return _keep_local_spares()


def wait_for_cleanup() -> None:
    """Wait until every backend's background deletions are done (a plugin's teardown: no hidden file is left)."""
    for backend in BACKENDS:
        backend.wait_for_cleanup()
