"""Every private name of fsspec and s3fs the format layer uses, in one place (the format layer cannot import the
Lightning adapter, ``_lightning_adapter``, which holds Lightning's and torch's). Check these on an fsspec or s3fs
release:

- ``S3FileSystem._cache``: s3fs's cache of instances, shared with our subclass so that clearing s3fs's (after the
  environment's credentials or endpoint changed) clears ours too;
- ``AbstractFileSystem._get_kwargs_from_urls`` and ``_strip_protocol``: the options a URL carries (an S3 endpoint in
  ``s3://...``) and the path it names, for a file system class we instantiate ourselves;
- ``AbstractBufferedFile.discard`` and its ``closed`` flag: an upload dropped (a multipart upload aborted) and never
  completed when the file object is collected.

fsspec and s3fs are imported only when these are called.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any


@functools.cache
def bounded_s3(attempts: int) -> Any:
    """s3fs's file system with ``attempts`` of its own retry loop (s3fs has no option for it): a class of its own,
    so no instance of s3fs's is changed (fsspec's cache keys hold the class), in s3fs's cache of instances."""
    from s3fs import S3FileSystem

    class BoundedS3FileSystem(S3FileSystem):
        retries = attempts

    BoundedS3FileSystem._cache = S3FileSystem._cache
    return BoundedS3FileSystem


def instance(cls: Any, url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """``cls`` (a file system class) for ``url``, with the options the URL carries under ``options``, and the path
    ``url`` names on it (as ``fsspec.url_to_fs`` does for the class fsspec registered)."""
    return cls(**{**cls._get_kwargs_from_urls(url), **options}), cls._strip_protocol(url)


def abandon(file: Any) -> None:
    """Drop an upload in progress: nothing appears (a multipart upload is aborted), now or when ``file`` is
    collected (fsspec's ``__del__``/``close`` would complete it)."""
    with contextlib.suppress(Exception):
        file.discard()
    with contextlib.suppress(AttributeError):  # (a file that is no AbstractBufferedFile has no such setter)
        file.closed = True
