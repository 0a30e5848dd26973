"""Which operating-system tricks the format layer may use.

Linux (and some Unix) calls make saves and loads faster or safer: ``O_DIRECT`` and ``RWF_NOWAIT`` reads and
``posix_fadvise`` (``diskio.read_range``), ``sync_file_range`` write-behind through ``ctypes.CDLL(None)``
(``diskio.WriteBehind``), ``writev`` (the writer), ``preadv``, transparent huge pages (``MADV_HUGEPAGE``),
``O_NONBLOCK`` so that opening a FIFO cannot hang (``diskio.open_regular``), ``O_DIRECTORY`` for fsyncing a
directory, ``os.kill(pid, 0)`` to tell a live writer from a dead one, and a write lease (``F_SETLEASE``) before a
save writes over a retired file (``atomic``). Each use is feature-detected where it is made, and each has a portable
fallback: plain reads and writes, ``stat`` before ``open``, ``fsync`` and ``rename``, which every platform has. Setting the environment variable ``LIGHTNING_ORT_CKPT_PORTABLE_IO=1`` turns
every trick off, so the portable path can be used (and is tested, ``tests/format/test_portable_io.py``) on Linux.
"""

from __future__ import annotations

import os

PORTABLE_IO_ENV = "LIGHTNING_ORT_CKPT_PORTABLE_IO"


def portable_io() -> bool:
    """Whether the user asked for the portable path only (read at each call, so tests may switch it)."""
    return os.environ.get(PORTABLE_IO_ENV, "").strip().lower() not in ("", "0", "false", "no")
