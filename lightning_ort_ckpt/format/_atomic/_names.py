"""The names a save gives its files: the checkpoint's companions (``.data``, the journal), and hidden temporaries and
retired files tagged with a token saying which process of which boot of which host made them, so that leftovers can
be told from a live writer's (:func:`dead`).

Every name derived from a checkpoint's (temporaries, journal) fits wherever the checkpoint's own name fits: a name
longer than the file system allows is cut short and tagged with a hash of the whole name (:func:`_fitting`).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket

from ...errors import CheckpointSaveError
from .._naming import DATA_SUFFIX
from .._platform import portable_io

JOURNAL_SUFFIX = ".commit"


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _boot_id() -> str:
    """This boot of this machine (Linux); elsewhere unknown ("0"), and then pids alone cannot say who is dead."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return _short_hash(f.read().strip())
    except OSError:
        return "0" * 8


HOST, BOOT = _short_hash(socket.gethostname()), _boot_id()
_TOKEN = r"(?P<host>[0-9a-f]{8})-(?P<boot>[0-9a-f]{8})\.(?P<pid>\d+)\.[0-9a-f]{8}"
LEFTOVER = re.compile(rf"^\..+\.{_TOKEN}\.(?:tmp|old)$")
OLD_LEFTOVER = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.(?:tmp|old)$")  # names of versions before the host tag
_ANY_TOKEN = rf"(?:{_TOKEN}|\d+\.[0-9a-f]{{8}})"


def token() -> str:
    """``<host>-<boot>.<pid>.<random>``: this process, in the names of the files it writes."""
    return f"{HOST}-{BOOT}.{os.getpid()}.{secrets.token_hex(4)}"


def _name_max(directory: str) -> int:
    """The longest file name ``directory`` takes, in bytes (255 where the system does not say)."""
    try:
        limit = os.pathconf(directory, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):  # no pathconf (Windows), or no such directory yet
        return 255
    return limit if limit > 0 else 255


def _fitting(directory: str, head: str, base: str, tail: str) -> str:
    """``head + base + tail``, or where that is longer than ``directory`` allows, with ``base`` cut short and tagged
    ``~<hash of base>``: a name derived from a checkpoint's must fit wherever the checkpoint's own name fits."""
    limit = _name_max(directory)
    if len(os.fsencode(head + base + tail)) <= limit:
        return head + base + tail
    tag = f"~{_short_hash(base)}"
    cut = base
    while cut and len(os.fsencode(head + cut + tag + tail)) > limit:  # whole characters, never half of one
        cut = cut[:-1]
    return head + cut + tag + tail


def hidden_name(path: str, tag: str, suffix: str) -> str:
    """``.<name>.<tag>.<suffix>`` beside ``path`` (cut short where too long)."""
    directory, base = os.path.split(path)
    return os.path.join(directory, _fitting(directory, ".", base, f".{tag}.{suffix}"))


def token_of(name: str, base: str) -> str | None:
    """The token of ``name`` when it is a temporary name :func:`hidden_name` gives a file named ``base`` (whole or
    cut short), else None."""
    m = re.fullmatch(rf"(?s)\.(?:{re.escape(base)}|(?P<cut>.*)~{_short_hash(base)})\.(?P<t>{_ANY_TOKEN})\.tmp", name)
    if m is None or (m.group("cut") is not None and not base.startswith(m.group("cut"))):
        return None
    return m.group("t")


def journal_path(path: str) -> str:
    """The commit journal of ``path``: ``<path>.commit``, cut short (see :func:`_fitting`) where that is too long."""
    directory, base = os.path.split(path)
    return os.path.join(directory, _fitting(directory, "", base, JOURNAL_SUFFIX))


def check_names_fit(path: str, with_data: bool) -> None:
    """Refuse, before anything is written, a checkpoint or ``.data`` name longer than the file system allows: ORT
    names the ``.data`` file after the checkpoint, so it cannot be cut short like our temporaries."""
    directory, base = os.path.split(path)
    limit = _name_max(directory)
    size = len(os.fsencode(base))
    if size > limit:
        raise CheckpointSaveError(f"the file name is {size} bytes long and this file system allows at most {limit}; "
                                  "nothing was written", path)
    size += len(DATA_SUFFIX)
    if with_data and size > limit:
        raise CheckpointSaveError(
            f"the name of its external data file (this name plus {DATA_SUFFIX}) would be {size} bytes long and this "
            f"file system allows at most {limit}: ORT names that file after the checkpoint, so a checkpoint with a "
            f"{DATA_SUFFIX} file needs a name of at most {limit - len(DATA_SUFFIX)} bytes; nothing was written", path)


def trash_name(path: str) -> str:
    """A hidden second name for ``path`` while it waits to be unlinked."""
    return hidden_name(path, token(), "old")


def temp_name(path: str) -> str:
    """A hidden temporary name beside ``path``, of this process: if the process dies, the next save to the folder
    sweeps it as a leftover."""
    return hidden_name(path, token(), "tmp")


def dead(m: re.Match[str]) -> bool | None:
    """Whether the process a token names has ended: True, False, or None where we cannot tell (another host, or
    no way to probe a pid here)."""
    if m.group("host") != HOST:
        return None
    if m.group("boot") != BOOT:  # an earlier boot of this machine: all its processes are gone
        return True if BOOT != "0" * 8 else None
    pid = int(m.group("pid"))
    if pid == os.getpid():
        return False
    if os.name != "posix" or portable_io():  # elsewhere os.kill would kill, not probe
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, someone else's
        return False
    return False
