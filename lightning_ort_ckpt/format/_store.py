"""Where checkpoint files live: the one place that asks "local disk or remote store?".

Every layer above reads and writes checkpoint files through a :class:`Store`, chosen once per path by
:func:`store_for`: a local path (no ``protocol://``) gets :class:`~._local_store.LocalStore` (the journaled atomic
commit, durable directories, writer locks, hard and symbolic links); any fsspec URL (S3, GCS, Azure, ``memory://``)
gets :class:`~._fsspec_store.FsspecStore`, which swaps the file system and keeps everything else. A ``file://`` URL
is the local path it names (:func:`local_path`). A new backend is one more class with these methods.

The save pipeline is the same for every store (``_writer``): plan every byte, open the new files with
:meth:`Store.writing`, stream the tensors into them, and leave the block: the store commits (atomically, or not at
all). A store that cannot write back into a file it streamed (an upload) says so with ``rewritable = False``; the
writer then hashes the tensors before streaming instead of filling the checksum record afterwards.
"""

from __future__ import annotations

import os
import re
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ._atomic import SaveFiles
from ._fsspec_store import FsspecStore
from ._local_store import LocalStore
from ._shared_data import Identity

StorageOptions = dict[str, Any]
"""fsspec's keyword arguments for the file system of a URL (credentials, ``client_kwargs``, s3fs's
``default_block_size``...)."""

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://|::")  # two letters at least: "C:\..." is a Windows path
_LOCAL_PROTOCOLS = {"file", "local"}


class Store(Protocol):
    """Stores checkpoint files (each with its ``.data`` companion) by path or URL."""

    rewritable: bool
    """Whether the writer may write into a new file after streaming it (the checksum record); else it hashes first."""
    links: bool
    """Whether a new ``.data`` can be a hard link to an existing one (frozen sharing, ``format._shared_data``)."""
    local: bool
    """Whether its paths are the local file system's: :meth:`fetched` hands back the file itself (no download)."""

    def writing(self, path: str, *, with_data: bool, required_bytes: int,
                link_data: tuple[str, Identity] | None = None) -> AbstractContextManager[SaveFiles]:
        """New files to stream into; on a clean exit they replace ``path`` (and its ``.data``) whole, ``.data``
        first; on an exception nothing changes. ``link_data``: make ``.data`` a hard link to that file instead,
        where the store can (``SaveFiles.linked``)."""
        ...

    def fetched(self, path: str) -> AbstractContextManager[str]:
        """A local path holding ``path`` and its ``.data`` for the length of the block."""
        ...

    def read_head(self, path: str, size: int) -> bytes:
        """The first ``size`` bytes of a file; b"" when it cannot be read (missing, a directory, not a file)."""
        ...

    def exists(self, path: str) -> bool: ...

    def modified(self, path: str) -> float:
        """Last modification time (seconds since the epoch); ``-inf`` when unknown."""
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

    def join(self, directory: str, name: str) -> str:
        """``name`` inside ``directory``, spelled as the store spells its paths."""
        ...

    def absolute(self, path: str) -> str:
        """One spelling per file, to compare paths (a local path made absolute; a URL as it is)."""
        ...

    def size(self, path: str) -> int:
        """The bytes of a file and its ``.data``, or of everything in a folder; 0 when it is gone."""
        ...

    def contains(self, directory: str, path: str) -> bool:
        """Whether ``path`` lies in ``directory`` or below it, after ``..`` and links in its folders are resolved
        (the name itself is never followed)."""
        ...


def is_remote(path: str | os.PathLike[str] | None) -> bool:
    """Whether ``path`` is a URL of a file system other than the local one."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    text = os.fspath(path)
    if not _URL.search(text):
        return False
    from fsspec.utils import get_protocol

    return get_protocol(text) not in _LOCAL_PROTOCOLS


def local_path(path: str | os.PathLike[str]) -> str:
    """``path``, with a URL of the local file system (``file:///tmp/run``) turned into the path it names
    (``/tmp/run``), so that it gets the local disk's atomic commit and links (Lightning's ``ModelCheckpoint`` would
    make a folder named ``file:`` of it)."""
    text = os.fspath(path)
    return strip_protocol(text) if _URL.search(text) and not is_remote(text) else text


def strip_protocol(url: str) -> str:
    """The path of ``url`` as its file system names it (``s3://bucket/key`` -> ``bucket/key``)."""
    from fsspec.core import strip_protocol as strip

    return strip(url)


def store_for(path: str | os.PathLike[str] | None, storage_options: StorageOptions | None = None) -> Store:
    """The store of ``path``: the local disk, or the fsspec file system of a URL (with ``storage_options``)."""
    return FsspecStore(storage_options) if is_remote(path) else LocalStore()

