"""How a path names its file system: a local path, or a URL (``protocol://``) of an fsspec file system. Only the
stores ask (each backend's ``handles``); fsspec is imported only for a URL."""

from __future__ import annotations

import os
import re

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://|::")  # two letters at least: "C:\..." is a Windows path
_LOCAL_PROTOCOLS = {"file", "local"}


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
