"""Any fsspec file system as a checkpoint store (S3, GCS, Azure, ``memory://``, ...): the local store's contract with
the file system swapped, as ``torch.distributed.checkpoint``'s ``FsspecWriter`` does. fsspec is imported only here,
and only when a URL is used.

An object store has no rename and no fsync, so a save streams each file to its final name and the store makes it
appear whole or not at all: S3 (like GCS and Azure) publishes an upload only when it is completed, after the last
byte; any failure aborts the upload instead (fsspec's file ``__exit__`` would complete it, so it is never used for
writing), and the previous object stays. ``.data`` is completed before the checkpoint that needs it. Memory stays
bounded: the writer hands the store at most ``BEHIND_BYTES`` per write, and the store's client holds one block
(``block_size`` in ``storage_options``) before it sends it as one part. On a file system that shows a file while it
is being written (``memory://``, unknown protocols) each file is written under a hidden temporary name and moved
into place. Reading downloads the file (and its ``.data``) into a temporary folder; an error names the URL, not the
temporary copy.

S3 gets limits of ours (``S3_LIMITS``) under the user's ``storage_options``, so that a request to an endpoint that
does not answer fails within about 15 s (unreachable) or 45 s (silent), not minutes: botocore's connect and read
timeouts and retries (``config_kwargs``; the user's keys win, a ``retries`` of theirs replaces ours whole), and
s3fs's own retry loop around each botocore call (a class attribute in s3fs, 5 attempts): the file system is an
``S3FileSystem`` subclass of ours with one (``_fsspec_compat``, with every private fsspec and s3fs name we use). fsspec caches file system instances per class and options, so no
instance other code holds is changed.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import secrets
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from ..errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from ._atomic import DATA_SUFFIX, FOLDER_COMMIT_NAME, SaveFiles, data_path
from ._fsspec_compat import abandon, bounded_s3, instance
from ._urls import is_remote

_WHOLE_ON_COMPLETE = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}
"""Stores that publish an upload only once it is completed, and drop it when it is aborted (``discard``)."""


_S3_PROTOCOLS = {"s3", "s3a"}
S3_LIMITS: dict[str, Any] = {"connect_timeout": 5, "read_timeout": 15,
                             "retries": {"mode": "standard", "total_max_attempts": 3}}
"""botocore's ``config_kwargs`` for S3 unless ``storage_options`` say otherwise: seconds to connect, seconds a response
may stay silent (s3fs's own defaults), attempts per call with botocore's capped exponential backoff."""
S3FS_ATTEMPTS = 1
"""Attempts of s3fs's own loop around each botocore call (5 in s3fs), which would multiply botocore's: one, so that
botocore's ``retries`` are the one setting (it retries timeouts, 5xx answers and throttling itself). The cost: a
download whose body breaks midway is not resumed by s3fs; the read fails with our error and can be run again."""


class FsspecStore:
    """Checkpoint files on an fsspec file system, by URL (see ``_store.Store`` for each method's contract)."""

    rewritable = False  # an upload cannot be written back into: the writer hashes first
    links = False
    local = False

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = storage_options or {}

    @classmethod
    def handles(cls, path: str | os.PathLike[str] | None) -> bool:
        """Every URL of a file system other than the local one (fsspec knows the protocol, or says it does not)."""
        return is_remote(path)

    @classmethod
    def wait_for_cleanup(cls) -> None:
        """Nothing to wait for: objects are deleted on the caller's thread."""

    def in_memory(self, path: str) -> bool:
        return False  # (fsspec's memory:// is too, but a Python dict's copy is no faster than staging's)

    def _fs(self, url: str) -> tuple[Any, str]:
        from fsspec.core import split_protocol, url_to_fs

        if split_protocol(url)[0] in _S3_PROTOCOLS and "::" not in url:
            config = {**S3_LIMITS, **(self.storage_options.get("config_kwargs") or {})}
            return instance(bounded_s3(S3FS_ATTEMPTS), url, {**self.storage_options, "config_kwargs": config})
        return url_to_fs(url, **self.storage_options)

    @contextlib.contextmanager
    def writing(self, path: str, *, with_data: bool, required_bytes: int,
                link_data: Callable[[str], bool] | None = None) -> Iterator[SaveFiles]:
        uploads: list[_Upload] = []
        data_done = False
        try:
            fs, where = self._fs(path)  # an unknown protocol, or its package missing, fails here
            fs.makedirs(posixpath.dirname(where), exist_ok=True)
            main = _Upload(fs, where)
            uploads.append(main)
            data = _Upload(fs, data_path(where)) if with_data else None
            if data is not None:
                uploads.append(data)
            yield SaveFiles(main.file, data.file if data is not None else None)
            if data is not None:
                data.complete()
                data_done = True
            main.complete()
        except BaseException as e:
            for upload in uploads:
                upload.abort()
            if not isinstance(e, Exception) or isinstance(e, CheckpointSaveError):
                raise
            outcome = (f"its new {DATA_SUFFIX} file was stored already: a previous checkpoint at this path does "
                       "not load (a checksum error) until the next save of it" if data_done
                       else "the previous checkpoint at this path, if any, is unchanged")
            raise CheckpointSaveError(f"save failed ({type(e).__name__}: {e}); {outcome}", path) from e

    @contextlib.contextmanager
    def fetched(self, path: str) -> Iterator[str]:
        with tempfile.TemporaryDirectory(prefix="ort-ckpt-") as folder:
            try:
                fs, where = self._fs(path)
                local = os.path.join(folder, posixpath.basename(where) or "checkpoint")
                fs.get_file(where, local)
                if fs.isfile(data_path(where)):
                    fs.get_file(data_path(where), data_path(local))
            except FileNotFoundError:
                raise CorruptCheckpointError("no such checkpoint file", path) from None
            except IsADirectoryError:
                raise CorruptCheckpointError("a directory, not a checkpoint file", path) from None
            except Exception as e:  # noqa: BLE001 - each store raises its own types
                raise CheckpointError(f"cannot download the checkpoint ({type(e).__name__}: {e})", path) from e
            try:
                yield local
            except CheckpointError as e:
                raise _renamed(e, local, path) from None

    def read_head(self, path: str, size: int) -> bytes:
        fs, where = self._fs(path)
        try:
            return bytes(fs.cat_file(where, start=0, end=size))
        except Exception:  # noqa: BLE001 - missing, a directory, no access: nothing to read
            return b""

    def check_file(self, path: str) -> None:
        """An object store holds no FIFOs nor devices: nothing to refuse."""

    def exists(self, path: str) -> bool:
        fs, where = self._fs(path)
        fs.invalidate_cache(posixpath.dirname(where))  # another process (or file system object) may have changed it
        return bool(fs.exists(where))

    def is_directory(self, path: str) -> bool:
        fs, where = self._fs(path)
        fs.invalidate_cache(posixpath.dirname(where))
        return bool(fs.isdir(where))

    def join(self, directory: str, name: str) -> str:
        return directory.rstrip("/") + "/" + name

    def absolute(self, path: str) -> str:
        return path

    def temp_name(self, path: str) -> str:
        return _hidden(path)

    def modified(self, path: str) -> float:
        try:
            fs, where = self._fs(path)
            return float(fs.modified(where).timestamp())
        except (OSError, NotImplementedError, ValueError):
            return float("-inf")

    def list_files(self, directory: str, recursive: bool) -> list[str]:
        return self._listed(directory, recursive, "file")

    def list_folders(self, directory: str, recursive: bool) -> list[str]:
        return self._listed(directory, recursive, "directory")

    def _listed(self, directory: str, recursive: bool, kind: str) -> list[str]:
        """The visible entries of type ``kind`` (fsspec's "file" or "directory") in or below ``directory``."""
        fs, where = self._fs(directory)
        fs.invalidate_cache(where)
        if not fs.isdir(where):
            return []
        found = fs.find(where, maxdepth=None if recursive else 1, withdirs=True, detail=True)
        root = where.rstrip("/") + "/"
        relative = (p[len(root):] for p, info in found.items() if p.startswith(root) and info.get("type") == kind)
        return sorted(f"{directory.rstrip('/')}/{r}" for r in relative
                      if r and not any(n.startswith(".") for n in r.split("/")))

    def remove(self, path: str) -> None:
        """A folder (a sharded checkpoint) goes whole: its commit file (``FOLDER_COMMIT_NAME``) first, so that no
        reader takes what is left for a checkpoint while the rest is deleted, then every object below it."""
        url = path
        try:
            fs, where = self._fs(path)
            if fs.isdir(where):
                commit = f"{where.rstrip('/')}/{FOLDER_COMMIT_NAME}"
                if fs.exists(commit):
                    fs.rm_file(commit)
                fs.rm(where, recursive=True)
                fs.invalidate_cache(where)
                return
            for url, victim in ((path, where), (data_path(path), data_path(where))):
                if fs.exists(victim):
                    fs.rm_file(victim)
        except Exception as e:  # noqa: BLE001 - each store raises its own types
            raise CheckpointError(f"cannot delete it ({type(e).__name__}: {e})", url) from e

    def link_or_copy(self, target: str, linkpath: str) -> None:
        """A server-side copy: a store has no links (``.data`` first, each object whole or not at all)."""
        fs, where = self._fs(linkpath)
        _, source = self._fs(target)
        try:
            with_data = fs.isfile(data_path(source))
            if with_data:
                fs.copy(data_path(source), data_path(where))
            fs.copy(source, where)
            if not with_data and fs.isfile(data_path(where)):
                fs.rm_file(data_path(where))  # an earlier last file's, which the new one (all inline) ignores
        except Exception as e:  # noqa: BLE001 - each store raises its own types
            raise CheckpointSaveError(f"cannot copy {target} to the last checkpoint ({type(e).__name__}: {e})",
                                      linkpath) from e

    def link_target(self, path: str) -> str | None:
        return None

    def size(self, path: str) -> int:
        fs, where = self._fs(path)
        try:
            if fs.isdir(where):
                return int(sum(info.get("size") or 0 for info in fs.find(where, detail=True).values()))
            return int(sum(fs.size(p) for p in (where, data_path(where)) if fs.isfile(p)))
        except (OSError, ValueError):
            return 0

    def contains(self, directory: str, path: str) -> bool:
        root, folder = posixpath.normpath(directory), posixpath.normpath(posixpath.dirname(path))
        return folder == root or folder.startswith(root.rstrip("/") + "/")


class _Upload:
    """One object being uploaded: published by :meth:`complete` only if every byte got there, else :meth:`abort`."""

    def __init__(self, fs: Any, where: str) -> None:
        self._fs, self._where = fs, where
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        self._temporary: str | None = None
        if not protocols & _WHOLE_ON_COMPLETE:  # a file system that shows files being written: a hidden name first
            self._temporary = _hidden(where)
        self.file: BinaryIO = fs.open(self._temporary or where, "wb")

    def complete(self) -> None:
        self.file.close()  # the last part, then the upload's completion: the object appears now
        if self._temporary is not None:
            self._fs.mv(self._temporary, self._where)
            self._temporary = None

    def abort(self) -> None:
        abandon(self.file)
        if self._temporary is not None:
            with contextlib.suppress(Exception):
                self._fs.rm(self._temporary)


def _hidden(path: str) -> str:
    """A hidden temporary name beside ``path`` (a URL, or a path on its file system)."""
    folder, name = posixpath.split(path)
    return posixpath.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")


def _renamed(error: CheckpointError, local: str, url: str) -> CheckpointError:
    """``error`` about the downloaded copy, naming the URL instead."""
    text = str(error)
    if error.path is not None and text.startswith(f"{error.path}: "):
        text = text[len(error.path) + 2:]
    renamed = type(error)(text.replace(local, url), url if error.path in (None, local) else error.path)
    renamed.__cause__ = error.__cause__
    return renamed
