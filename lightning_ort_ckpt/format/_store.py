"""Where checkpoint files live: the local disk, or any fsspec file system (S3, GCS, Azure, ``memory://``, ...).

One small interface for the layers above, by path or URL and fsspec ``storage_options``: :func:`save`, :func:`fetched`
(a local file to read), :func:`remove`, :func:`link_or_copy`, :func:`exists`, :func:`modified`, :func:`list_files`
and :func:`read_head`. A local path (no ``protocol://``) goes exactly where it went before: the
journaled atomic commit of ``atomic``, plain ``os`` calls; a ``file://`` URL is that local path (:func:`local_path`,
applied where paths come in). fsspec is imported only for a URL.

An object store has no rename and no fsync, so a remote save streams the file to its final name, and the store makes
it appear whole or not at all: S3 (like GCS and Azure) publishes an upload only when it is completed, which happens
after the last byte; any failure aborts the upload instead (fsspec's file ``__exit__`` would complete it, so it is
never used for writing), and the previous object stays. The checksum record, which a local save writes back into the
file once the tensors are streamed, is computed by a hashing pass before the upload: nothing is ever seeked back.
``.data`` is uploaded before the checkpoint that needs it. Memory stays bounded: the writer hands the store at most
``BEHIND_BYTES`` per write, and the store's client holds one block (``block_size`` in ``storage_options``) before it
sends it as one part. On a file system that shows a file while it is being written (``memory://``, unknown
protocols) the file is written under a hidden temporary name and moved into place.

Reading downloads the file (and its ``.data``) into a temporary folder and reads it there, with every check of the
reader; an error names the URL, not the temporary copy.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import secrets
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from ..errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from . import _atomic
from . import _checksums
from ._contents import CheckpointContents
from ._writer import ExternalData, _Hashing, _plan_for_mode, _stream, _stream_external, _Tensors, save_checkpoint

StorageOptions = dict[str, Any]
"""fsspec's keyword arguments for the file system of a URL (credentials, ``client_kwargs``, s3fs's
``default_block_size``...)."""

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://|::")  # two letters at least: "C:\..." is a Windows path
_LOCAL_PROTOCOLS = {"file", "local"}
_WHOLE_ON_COMPLETE = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}
"""Stores that publish an upload only once it is completed, and drop it when it is aborted (``discard``)."""


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


def _fs(url: str, storage_options: StorageOptions | None) -> tuple[Any, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(url, **(storage_options or {}))


def _protocols(fs: Any) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


# -- saving -----------------------------------------------------------------------------------------------------
def save(checkpoint: CheckpointContents, path: str | os.PathLike[str], *, external_data: ExternalData = "auto",
         storage_options: StorageOptions | None = None) -> None:
    """Write ``checkpoint`` to ``path``: atomically on the local disk (``save_checkpoint``), streamed to the store
    for a URL (``.data`` first; the checkpoint appears whole or not at all, module doc)."""
    path = os.fspath(path)
    if not is_remote(path):
        save_checkpoint(checkpoint, path, external_data=external_data)
        return
    tensors = _Tensors(path)
    plan = _plan_for_mode(checkpoint, tensors, external_data, path)
    unhashed = _Hashing(tensors, False)
    data_replaced = False
    try:
        record = plan.checksums.fill(_digests(tensors)) if plan.checksums is not None else None
        fs, where = _fs(path, storage_options)  # an unknown protocol, or its package missing, fails here
        fs.makedirs(posixpath.dirname(where), exist_ok=True)
        if plan.data_size is not None:
            _upload(fs, _atomic.data_path(where), lambda out: _stream_external(out, plan.external, tensors, unhashed))
            data_replaced = True
        written = _upload(fs, where, lambda out: _stream(out, plan.pieces, tensors, unhashed, record))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - each store raises its own types (botocore, aiohttp, OSError...)
        outcome = (f"its new {_atomic.DATA_SUFFIX} file was stored already: a previous checkpoint at this path does "
                   "not load (a checksum error) until the next save of it" if data_replaced
                   else "the previous checkpoint at this path, if any, is unchanged")
        raise CheckpointSaveError(f"save failed ({type(e).__name__}: {e}); {outcome}", path) from e
    if written != plan.size:  # pragma: no cover - planner and streamer disagree: a bug, never silently written
        raise CheckpointSaveError(f"internal error: planned {plan.size} bytes, wrote {written}", path)


def _digests(tensors: _Tensors) -> dict[str, int]:
    """Every tensor's checksum, read before the upload: a file being uploaded cannot be written back into."""
    found = {}
    for key, entry in enumerate(tensors.entries):
        if entry.checksum_key is not None:
            h = _checksums.hasher(int(entry.dtype), tuple(entry.dims))
            for chunk, _ in tensors.chunks(key):
                h.update(chunk)
            found[entry.checksum_key] = h.intdigest()
    return found


def _upload(fs: Any, where: str, write: Callable[[BinaryIO], int]) -> int:
    """Stream one object to ``where`` through ``write``; it is published only if every byte got there."""
    if _protocols(fs) & _WHOLE_ON_COMPLETE:
        return _write_whole(fs, where, write)
    folder, name = posixpath.split(where)
    temporary = posixpath.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
    try:
        written = _write_whole(fs, temporary, write)
        fs.mv(temporary, where)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(temporary)
        raise
    return written


def _write_whole(fs: Any, where: str, write: Callable[[BinaryIO], int]) -> int:
    out = fs.open(where, "wb")
    try:
        written = write(out)
        out.close()  # the last part, then the upload's completion: the object appears now
    except BaseException:
        with contextlib.suppress(Exception):
            out.discard()  # aborts the multipart upload: nothing appears, the previous object stays
        with contextlib.suppress(AttributeError):  # (a file that is no AbstractBufferedFile has no such setter)
            out.closed = True  # no completion at garbage collection either
        raise
    return written


# -- reading ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fetched(path: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> Iterator[str]:
    """A local path holding the checkpoint at ``path`` (and its ``.data``) for the length of the block: ``path``
    itself on the local disk, a downloaded copy of a URL. Our errors inside the block name ``path``."""
    path = os.fspath(path)
    if not is_remote(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="ort-ckpt-") as folder:
        try:
            fs, where = _fs(path, storage_options)
            local = os.path.join(folder, posixpath.basename(where) or "checkpoint")
            fs.get_file(where, local)
            if fs.isfile(_atomic.data_path(where)):
                fs.get_file(_atomic.data_path(where), _atomic.data_path(local))
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


def _renamed(error: CheckpointError, local: str, url: str) -> CheckpointError:
    """``error`` about the downloaded copy, naming the URL instead."""
    text = str(error)
    if error.path is not None and text.startswith(f"{error.path}: "):
        text = text[len(error.path) + 2:]
    renamed = type(error)(text.replace(local, url), url if error.path in (None, local) else error.path)
    renamed.__cause__ = error.__cause__
    return renamed


def read_head(path: str | os.PathLike[str], size: int, storage_options: StorageOptions | None = None) -> bytes:
    """The first ``size`` bytes of a remote file (for telling ORT files from torch files); b"" when unreadable."""
    fs, where = _fs(os.fspath(path), storage_options)
    try:
        return bytes(fs.cat_file(where, start=0, end=size))
    except Exception:  # noqa: BLE001 - missing, a directory, no access: not an ORT checkpoint to us
        return b""


# -- the directory: listing, removal, "links" -------------------------------------------------------------------
def exists(path: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    fs, where = _fs(os.fspath(path), storage_options)
    fs.invalidate_cache(posixpath.dirname(where))  # another process (or file system object) may have changed it
    return bool(fs.exists(where))


def modified(path: str, storage_options: StorageOptions | None = None) -> float:
    """Last modification time (seconds since the epoch); ``-inf`` when unknown."""
    try:
        if not is_remote(path):
            return os.stat(path).st_mtime
        fs, where = _fs(path, storage_options)
        return float(fs.modified(where).timestamp())
    except (OSError, NotImplementedError, ValueError):
        return float("-inf")


def list_files(directory: str, recursive: bool, storage_options: StorageOptions | None = None) -> list[str]:
    """The files in a remote ``directory`` (and below it when ``recursive``), as URLs spelled as ``directory`` is;
    [] when it does not exist. Names starting with a dot (our temporaries) are left out, as are such folders."""
    fs, where = _fs(directory, storage_options)
    fs.invalidate_cache(where)
    if not fs.isdir(where):
        return []
    found = fs.find(where, maxdepth=None if recursive else 1)
    root = where.rstrip("/") + "/"
    relative = (p[len(root):] for p in found if p.startswith(root))
    return sorted(f"{directory.rstrip('/')}/{r}" for r in relative if not any(n.startswith(".") for n in r.split("/")))


def remove(path: str, storage_options: StorageOptions | None = None) -> None:
    """Delete a checkpoint and its ``.data``: the checkpoint first, so no reader finds one without its data."""
    if not is_remote(path):
        _atomic.remove(path)
        return
    fs, where = _fs(path, storage_options)
    for victim in (where, _atomic.data_path(where)):
        if fs.exists(victim):
            fs.rm_file(victim)


def link_or_copy(target: str, linkpath: str, storage_options: StorageOptions | None = None) -> None:
    """``save_last="link"``: a symbolic link on the local disk (``_atomic.link``); a server-side copy on a store,
    which has no links (``.data`` first, each object whole or not at all)."""
    if not is_remote(linkpath):
        _atomic.link(target, linkpath)
        return
    fs, where = _fs(linkpath, storage_options)
    _, source = _fs(target, storage_options)
    try:
        with_data = fs.isfile(_atomic.data_path(source))
        if with_data:
            fs.copy(_atomic.data_path(source), _atomic.data_path(where))
        fs.copy(source, where)
        if not with_data and fs.isfile(_atomic.data_path(where)):
            fs.rm_file(_atomic.data_path(where))  # an earlier last file's, which the new one (all inline) ignores
    except Exception as e:  # noqa: BLE001 - each store raises its own types
        raise CheckpointSaveError(f"cannot copy {target} to the last checkpoint ({type(e).__name__}: {e})",
                                  linkpath) from e
