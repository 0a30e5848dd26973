"""Crash-safe, concurrency-safe replacement of a checkpoint and its ``.data`` companion.

A save writes temporary files (``.<name>.<token>.tmp``) in the target's directory, fsyncs them and renames them into
place, so a failure, a full disk or a kill leaves the previous checkpoint untouched. A checkpoint with external data
is two files that cannot be renamed together; a small journal (``<path>.commit``), written durably before the first
rename, records the pair and marks the commit in progress. Only writers act on it: the next save of the path (or
:func:`repair`) completes an interrupted commit, renaming nothing but the journal's two temporaries, and only when
their names follow our pattern. Readers never change the directory: :func:`open_pair` opens a consistent pair (old or
new, whole) even while a commit is in progress or after a writer died in one, or says that it could not.

Writers of one directory take a lock for the short commit (``flock`` on the directory, or a lock file where that is
not available), so two processes saving the same path never undo each other's renames. Replaced and removed files
get a hidden second name (``.<name>.<token>.old``; a removed checkpoint folder too, as a whole) and are unlinked on
a background thread (freeing gigabytes can take seconds on these disks); the queue is drained at exit, or by
:func:`drain_deletions`. The token is ``<host>-<boot>.<pid>.<random>``: leftovers of a killed save are swept only
when they are this host's, of this boot and of a process that no longer runs (or of an earlier boot), so a shared
file system never loses another machine's save in progress; anything else is swept only when it is older than
:data:`STALE_AGE_S`. A process lists a directory for leftovers once (its first save there); later saves look again
only at the leftovers that had to wait.

Every name we derive from a checkpoint's (temporaries, journal) fits wherever the checkpoint's own name fits: a name
longer than the file system allows is cut short and tagged with a hash of the whole name (``_fitting``).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import os
import queue
import re
import secrets
import shutil
import socket
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from ..errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from ._platform import portable_io
from ._shared_data import Identity, link_into

try:
    import fcntl
except ImportError:  # not a POSIX system: the lock file is the only lock
    fcntl = None  # type: ignore[assignment]

DATA_SUFFIX = ".data"
FOLDER_COMMIT_NAME = "checkpoint.ort-meta"
"""The file whose presence makes a folder a checkpoint (a sharded one: ``_dcp_storage.METADATA_NAME``); a store that
deletes a folder object by object deletes it first."""
JOURNAL_SUFFIX = ".commit"
LOCK_NAME = ".ort_ckpt.lock"  # the writers' lock file, where the directory itself cannot be locked
STALE_AGE_S = 7 * 24 * 3600  # leftovers of other hosts, or named as older versions did, go only after this long
LOCK_STALE_S = 120.0  # a lock file this old is a dead writer's: a commit holds it for milliseconds
LOCK_WAIT_S = 300.0  # how long a writer waits for another writer's commit before it gives up
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO must not hang
_OPEN_ATTEMPTS = 100  # a reader retries this often (with growing sleeps, ~3 s in all) while saves race it


def data_path(path: str) -> str:
    """ORT's external data file: the checkpoint path string plus ``.data``."""
    return path + DATA_SUFFIX


# -- who we are: the token in every temporary name ---------------------------------------------------------------
def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _boot_id() -> str:
    """This boot of this machine (Linux); elsewhere unknown ("0"), and then pids alone cannot say who is dead."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return _short_hash(f.read().strip())
    except OSError:
        return "0" * 8


_HOST, _BOOT = _short_hash(socket.gethostname()), _boot_id()
_TOKEN = r"(?P<host>[0-9a-f]{8})-(?P<boot>[0-9a-f]{8})\.(?P<pid>\d+)\.[0-9a-f]{8}"
_LEFTOVER = re.compile(rf"^\..+\.{_TOKEN}\.(?:tmp|old)$")
_OLD_LEFTOVER = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}\.(?:tmp|old)$")  # names of versions before the host tag
_ANY_TOKEN = rf"(?:{_TOKEN}|\d+\.[0-9a-f]{{8}})"


def _token() -> str:
    return f"{_HOST}-{_BOOT}.{os.getpid()}.{secrets.token_hex(4)}"


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


def _hidden_name(path: str, token: str, suffix: str) -> str:
    directory, base = os.path.split(path)
    return os.path.join(directory, _fitting(directory, ".", base, f".{token}.{suffix}"))


def _token_of(name: str, base: str) -> str | None:
    """The token of ``name`` when it is a temporary name :func:`_hidden_name` gives a file named ``base`` (whole or
    cut short), else None."""
    m = re.fullmatch(rf"(?s)\.(?:{re.escape(base)}|(?P<cut>.*)~{_short_hash(base)})\.(?P<t>{_ANY_TOKEN})\.tmp", name)
    if m is None or (m.group("cut") is not None and not base.startswith(m.group("cut"))):
        return None
    return m.group("t")


def _journal_path(path: str) -> str:
    """The commit journal of ``path``: ``<path>.commit``, cut short (see :func:`_fitting`) where that is too long."""
    directory, base = os.path.split(path)
    return os.path.join(directory, _fitting(directory, "", base, JOURNAL_SUFFIX))


def _check_names_fit(path: str, with_data: bool) -> None:
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


def _trash_name(path: str) -> str:
    return _hidden_name(path, _token(), "old")


def temp_name(path: str) -> str:
    """A hidden temporary name beside ``path``, of this process: if the process dies, the next save to the folder
    sweeps it as a leftover."""
    return _hidden_name(path, _token(), "tmp")


# -- saving -------------------------------------------------------------------------------------------------------
@dataclass
class SaveFiles:
    """Open temporary files of a save in progress; ``data`` is None when the checkpoint has no external data."""

    main: BinaryIO
    data: BinaryIO | None
    linked: bool = False  # the .data temporary is a hard link to an existing file (see ``shared``): write nothing


@contextlib.contextmanager
def atomic_save(path: str, *, with_data: bool, required_bytes: int,
                link_data: tuple[str, Identity] | None = None) -> Iterator[SaveFiles]:
    """Yield temporary files to write; on a clean exit make them durable and move them to ``path``.

    ``link_data`` (a ``.data`` file and the inode it must be): the new ``.data`` is a hard link to it instead of a
    file to write, when that link can be made (``SaveFiles.linked``). On any exception before the commit the
    temporary files are removed and whatever was at ``path`` stays as it was.
    """
    target = os.path.abspath(path)
    directory = os.path.dirname(target)
    _makedirs_durably(directory)
    _check_names_fit(target, with_data)
    _sweep_stale(directory)
    free = shutil.disk_usage(directory).free
    if free < required_bytes:
        raise CheckpointSaveError(
            f"not enough free disk space: the checkpoint needs {required_bytes:,} bytes, {free:,} are free; "
            "nothing was written", path)
    token = _token()
    tmp_main = _hidden_name(target, token, "tmp")
    tmp_data = _hidden_name(data_path(target), token, "tmp") if with_data else None
    opened: list[BinaryIO] = []
    try:
        opened.append(open(tmp_main, "xb", buffering=0))
        linked = tmp_data is not None and link_data is not None and link_into(*link_data, tmp_data)
        if tmp_data is not None and not linked:
            opened.append(open(tmp_data, "xb", buffering=0))
        yield SaveFiles(opened[0], opened[1] if len(opened) > 1 else None, linked)
        for f in opened:
            os.fsync(f.fileno())
            f.close()
    except BaseException as e:
        for f in opened:
            f.close()
        _discard(tmp_main, tmp_data)
        # e.g. a tensor whose copy fails midway (a meta tensor); the writer words OSErrors (EFBIG, ENOSPC) itself
        if isinstance(e, Exception) and not isinstance(e, (CheckpointError, OSError)):
            raise CheckpointSaveError(f"save failed ({type(e).__name__}: {e}); the previous checkpoint at this "
                                      "path, if any, is unchanged", path) from e
        raise
    _commit_locked(target, tmp_main, tmp_data)


def _commit_locked(path: str, tmp_main: str, tmp_data: str | None) -> None:
    """Take the directory's lock, complete a dead writer's commit of ``path`` if any, then commit ours."""
    committing = False
    try:
        with _WriterLock(os.path.dirname(path)) as lock:
            _recover_locked(path, lock)
            committing = True
            _commit(path, tmp_main, tmp_data, lock)
    except BaseException:
        if not committing:
            _discard(tmp_main, tmp_data)
        raise


def _discard(*paths: str | None) -> None:
    for p in paths:
        if p is not None:
            with contextlib.suppress(OSError):
                os.unlink(p)


def _commit(path: str, tmp_main: str, tmp_data: str | None, lock: _WriterLock) -> None:
    """Move the durable temporaries to ``path`` (and its ``.data``); the caller holds the directory's lock.

    Until the journal is durable a failure removes both temporaries (a full disk gets its space back); after it, a
    failure is completed by the next writer, and readers see the pair the journal describes.
    """
    retired: list[str] = []
    journal = _journal_path(path)
    try:
        if tmp_data is None:
            try:
                retired += _retire(path)
                os.replace(tmp_main, path)
            except BaseException:
                _discard(tmp_main)
                raise
            lock.fsync()
            if os.path.lexists(data_path(path)):  # the replaced checkpoint's external data is now stale
                trash = _trash_name(data_path(path))
                os.replace(data_path(path), trash)
                retired.append(trash)
            return
        try:
            _write_durably(journal, json.dumps({"checkpoint": os.path.basename(tmp_main),
                                                "data": os.path.basename(tmp_data)}).encode(), lock)
        except BaseException:
            _discard(tmp_main, tmp_data)
            raise
        try:
            retired += _retire(data_path(path))
            _replace(tmp_data, data_path(path))
            retired += _retire(path)
            os.replace(tmp_main, path)
            lock.fsync()
            os.unlink(journal)
        except OSError as e:
            raise CheckpointSaveError(f"the save failed between its renames ({e.strerror or e}); readers see the "
                                      "old or the new checkpoint whole, and the next save of this path completes "
                                      "the new one", path) from e
    finally:
        for trash in retired:
            _UNLINKER.put(trash)


def _replace(source: str, target: str) -> None:
    """``os.replace``, also where both are names of one inode (a ``.data`` linked to the one it replaces): POSIX
    rename then does nothing, so the temporary name is removed here."""
    os.replace(source, target)
    if os.path.lexists(source):
        os.unlink(source)


def _write_durably(path: str, data: bytes, lock: _WriterLock) -> None:
    tmp = temp_name(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    lock.fsync()


def _retire(path: str) -> list[str]:
    """Give ``path`` a second name so that replacing it does not free its blocks on the caller's thread."""
    if not os.path.lexists(path) or os.path.islink(path):  # replacing a symbolic link frees nothing
        return []
    trash = _trash_name(path)
    try:
        os.link(path, trash, follow_symlinks=False)
    except (OSError, NotImplementedError):  # no hard links here: let the rename free the blocks
        return []
    return [trash]


def _makedirs_durably(directory: str) -> None:
    """``os.makedirs``, and each directory it creates is made durable by an fsync of its parent."""
    missing = []
    d = directory
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
        _fsync_dir(os.path.dirname(d))


def _fsync_dir(directory: str) -> None:
    """Make renames in ``directory`` durable (a no-op where a directory cannot be opened, as on Windows)."""
    flags = os.O_RDONLY | (0 if portable_io() else getattr(os, "O_DIRECTORY", 0))
    try:
        fd = os.open(directory, flags)
    except OSError:
        return
    try:
        _fsync_fd(fd)
    finally:
        os.close(fd)


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a directory; the rename is as durable as they allow
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EACCES):
            raise


# -- the writers' lock ----------------------------------------------------------------------------------------------
class _WriterLock:
    """Exclusive right to commit in a directory: ``flock`` on the directory itself (no file appears), or, where that
    is unavailable (no ``fcntl``, a file system without locks, or portable I/O), an exclusively created lock file
    naming its holder. Held only for the renames of a commit, a removal or a link."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._dir_fd: int | None = None
        self._lock_file: str | None = None

    def __enter__(self) -> _WriterLock:
        if fcntl is not None and not portable_io():
            with contextlib.suppress(OSError):
                fd = os.open(self.directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except OSError:
                    os.close(fd)
                    raise
                self._dir_fd = fd
                return self
        self._acquire_lock_file()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)  # closing releases the flock
            self._dir_fd = None
        if self._lock_file is not None:
            _discard(self._lock_file)
            self._lock_file = None

    def fsync(self) -> None:
        """Make the directory's entries durable."""
        if self._dir_fd is not None:
            _fsync_fd(self._dir_fd)
        else:
            _fsync_dir(self.directory)

    def _acquire_lock_file(self) -> None:
        name = os.path.join(self.directory, LOCK_NAME)
        owner = f"{_HOST}-{_BOOT}.{os.getpid()}".encode()
        deadline, pause = time.monotonic() + LOCK_WAIT_S, 0.001
        while True:
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if _lock_file_is_stale(name):
                    _discard(name)
                    continue
                if time.monotonic() > deadline:
                    raise CheckpointSaveError(f"another process has held the lock file {name} for over "
                                              f"{LOCK_WAIT_S:.0f} s; if no save is running, delete it") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
                continue
            except OSError as e:  # a read-only or full file system
                raise CheckpointSaveError(f"cannot create the writers' lock file ({e.strerror or e}); nothing was "
                                          "changed", name) from None
            try:
                os.write(fd, owner)
            except OSError as e:
                _discard(name)
                raise CheckpointSaveError(f"cannot write the writers' lock file ({e.strerror or e}); nothing was "
                                          "changed", name) from None
            finally:
                os.close(fd)
            self._lock_file = name
            return


def _lock_file_is_stale(name: str) -> bool:
    try:
        with open(name, "rb") as f:
            owner = f.read(64).decode("ascii", "replace")
        age = time.time() - os.stat(name).st_mtime
    except OSError:
        return False  # gone already: try again
    m = re.fullmatch(r"(?P<host>[0-9a-f]{8})-(?P<boot>[0-9a-f]{8})\.(?P<pid>\d+)", owner)
    return age > LOCK_STALE_S or (m is not None and _dead(m) is True)


# -- recovery (writers only) ----------------------------------------------------------------------------------------
def _read_journal(path: str) -> tuple[str, str] | None:
    """The two temporaries a pending commit of ``path`` names, or None: no journal, or one that is not ours (its
    names do not follow our temporary pattern for ``path``), which nothing acts on."""
    journal = _journal_path(path)
    try:
        fd = os.open(journal, os.O_RDONLY | _NONBLOCK)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read the commit journal {journal}: {e.strerror or e}", path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device is not ours, and must not hang us
            return None
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        names = json.loads(raw)
        main, data = names["checkpoint"], names["data"]
    except (ValueError, KeyError, TypeError):
        return None
    base = os.path.basename(path)
    token = _token_of(main, base) if isinstance(main, str) else None
    if token is None or not isinstance(data, str) or _token_of(data, base + DATA_SUFFIX) != token:
        return None
    directory = os.path.dirname(path)
    return os.path.join(directory, main), os.path.join(directory, data)


def _recover_locked(path: str, lock: _WriterLock) -> bool:
    """Complete the commit a dead writer left half done (the caller holds the lock, so no live writer owns it)."""
    names = _read_journal(path)
    if names is None:
        return False
    tmp_main, tmp_data = names
    retired: list[str] = []
    try:
        if os.path.lexists(tmp_data):
            if not os.path.lexists(tmp_main):  # not a state our commit leaves: keep the old pair
                _discard(tmp_data)
            else:
                retired += _retire(data_path(path))
                _replace(tmp_data, data_path(path))
        if os.path.lexists(tmp_main):
            retired += _retire(path)
            os.replace(tmp_main, path)
        lock.fsync()
        os.unlink(_journal_path(path))
    except OSError as e:
        raise CorruptCheckpointError(f"a save was interrupted while replacing this checkpoint and its .data file, "
                                     f"and completing it failed ({e}); retry with write access to the directory",
                                     path) from None
    finally:
        for trash in retired:
            _UNLINKER.put(trash)
    _forget_listing(os.path.dirname(path))  # a writer died here: what else it left, the next save's listing finds
    return True


def repair(path: str | os.PathLike[str]) -> bool:
    """Complete an interrupted commit of ``path`` now, as its next save would; True when there was one.

    Only the two temporary files a journal of ours names are renamed; a journal that names anything else is left
    alone. Leftovers of dead saves in the directory are queued for deletion too.
    """
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    with _WriterLock(directory) as lock:
        done = _recover_locked(path, lock)
    _sweep_stale(directory, relist=True)
    return done


# -- reading --------------------------------------------------------------------------------------------------------
def open_pair(path: str) -> tuple[int, int | None]:
    """Open ``path`` and its ``.data`` (None when there is no such regular file) as one consistent pair, changing
    nothing on disk.

    While a commit is in progress, or after a writer died in one, the journal says which files make a whole pair:
    the old pair until the new ``.data`` is in place, then the new ``.ckpt`` (still under its temporary name) with it.
    After opening, the reader checks that the journal is unchanged and that ``path`` still names the file it opened;
    if a save raced it, it tries again (bounded), then raises :class:`CheckpointError`. Errors opening ``path``
    itself propagate as ``OSError``.
    """
    pause = 0.0005
    for _ in range(_OPEN_ATTEMPTS):
        pair = _try_open_pair(path)
        if pair is not None:
            return pair
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)
    raise CheckpointError("the checkpoint kept changing while it was being opened (another process is saving it "
                          "over and over, or an interrupted save of the file it links to is pending: the next save "
                          "of that file, or lightning_ort_ckpt.format._atomic.repair, completes it); try again", path)


def _try_open_pair(path: str) -> tuple[int, int | None] | None:
    real = os.path.realpath(path) if os.path.islink(path) else None  # a link (last.ckpt): its target's commits
    target_pending = real is not None and _read_journal(real) is not None
    before = _read_journal(path)
    main, decided_late = path, False
    if before is not None:
        tmp_main, tmp_data = before
        if not os.path.lexists(tmp_data):
            if os.path.lexists(tmp_main):  # the new .data is in place, the new .ckpt not yet
                main = tmp_main
        else:
            decided_late = True  # the old pair, if the new .data was still a temporary after we opened it
    try:
        fd = os.open(main, os.O_RDONLY | _NONBLOCK)
    except FileNotFoundError:
        if main != path:  # renamed into place meanwhile
            return None
        raise
    data_fd: int | None = None
    try:
        with contextlib.suppress(OSError):
            data_fd = os.open(data_path(path), os.O_RDONLY | _NONBLOCK)
            if not stat.S_ISREG(os.fstat(data_fd).st_mode):  # not a data file: the reader says what it is
                os.close(data_fd)
                data_fd = None
        after = _read_journal(path)
        ok = after == before and not target_pending and (real is None or _read_journal(real) is None)
        if ok and main == path:
            ok = _same_file(fd, path) and (not decided_late or os.path.lexists(before[1]))  # type: ignore[index]
    except BaseException:
        _close(fd, data_fd)
        raise
    if ok:
        return fd, data_fd
    _close(fd, data_fd)
    return None


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _close(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)


# -- leftovers --------------------------------------------------------------------------------------------------------
_SWEPT_LOCK = threading.Lock()
_WAITING: dict[str, set[str]] = {}  # each directory this process listed -> the leftovers there that had to wait


def _sweep_stale(directory: str, *, relist: bool = False) -> None:
    """Queue for deletion what dead saves left in ``directory``: temporary files of interrupted saves, and replaced
    or deleted checkpoints killed before unlinking. Only this host's, of a dead process or an earlier boot; others'
    (and names of older versions) only once older than :data:`STALE_AGE_S`.

    The directory is listed once per process (or with ``relist``): a directory of many files costs one listing per
    run, not one per save. Later calls look again only at the leftovers that listing found and had to leave (a live
    writer's, another host's, recent ones of older versions)."""
    now = time.time()
    with _SWEPT_LOCK:
        names = None if relist else _WAITING.get(directory)
        if names is None:
            with os.scandir(directory) as entries:
                names = {e.name for e in entries if _LEFTOVER.match(e.name) or _OLD_LEFTOVER.match(e.name)}
        _WAITING[directory] = {name for name in names if not _swept(os.path.join(directory, name), now)}


def _swept(path: str, now: float) -> bool:
    """Queue the leftover ``path`` for deletion if its save is certainly dead; True when it is queued or gone."""
    try:
        st = os.lstat(path)
    except OSError:
        return True
    m = _LEFTOVER.match(os.path.basename(path))
    dead = _dead(m) if m is not None else None
    if dead is None:  # we cannot tell: only by age
        dead = now - max(st.st_mtime, st.st_ctime) > STALE_AGE_S
    if dead:
        _UNLINKER.put(path)
    return dead


def _forget_listing(directory: str) -> None:
    """Have the next save list ``directory`` again (a writer died there during this run)."""
    with _SWEPT_LOCK:
        _WAITING.pop(directory, None)


def _reset_sweeps() -> None:
    global _SWEPT_LOCK
    _SWEPT_LOCK = threading.Lock()  # a forked child gets the lock as its parent's other threads held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_sweeps)


def _dead(m: re.Match[str]) -> bool | None:
    """Whether the process a token names has ended: True, False, or None where we cannot tell (another host, or
    no way to probe a pid here)."""
    if m.group("host") != _HOST:
        return None
    if m.group("boot") != _BOOT:  # an earlier boot of this machine: all its processes are gone
        return True if _BOOT != "0" * 8 else None
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


class _Unlinker:
    """One daemon thread that deletes files in the order they were queued, running only while files are queued: it
    starts with the first, ends when the queue is empty, and is registered with ``atexit`` (to delete what is left
    at exit) only meanwhile, so importing the package starts and registers nothing."""

    def __init__(self) -> None:
        self._reset()
        self._fork_handled = False

    def _reset(self) -> None:
        self._queue: queue.Queue[str] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, path: str) -> None:
        with self._lock:
            self._queue.put(path)
            if self._thread is None:
                if not self._fork_handled and hasattr(os, "register_at_fork"):  # a forked child: no thread, fresh
                    os.register_at_fork(after_in_child=self._reset)
                    self._fork_handled = True
                atexit.register(self.drain)
                self._thread = threading.Thread(target=self._run, name="ort-ckpt-unlink", daemon=True)
                self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every queued file is deleted and the thread has ended (it ends as the queue empties); False
        when ``timeout`` seconds passed first."""
        done = self._queue.all_tasks_done
        with done:
            if not done.wait_for(lambda: not self._queue.unfinished_tasks, timeout):
                return False
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def drain(self) -> None:
        """Delete what is still queued on the calling thread too, and wait for the one being deleted and for the
        thread to end (no thread of ours runs while the interpreter finalizes)."""
        while True:
            try:
                path = self._queue.get_nowait()
            except queue.Empty:
                break
            self._unlink(path)
        self.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                try:
                    path = self._queue.get_nowait()
                except queue.Empty:  # nothing left: the thread and its atexit registration end
                    self._thread = None
                    atexit.unregister(self.drain)
                    return
            self._unlink(path)

    def _unlink(self, path: str) -> None:
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):  # a removed sharded checkpoint: all of it
                shutil.rmtree(path)
            else:
                os.unlink(path)
        self._queue.task_done()


_UNLINKER = _Unlinker()


def drain_deletions(timeout: float | None = None) -> bool:
    """Wait until the files saves and removals replaced or deleted are gone (they are unlinked on a background
    thread), so that no hidden ``.old`` file is left in the folder when training ends; False when ``timeout``
    seconds passed first."""
    return _UNLINKER.join(timeout)


def wait_for_cleanup() -> None:
    """:func:`drain_deletions` without a time limit (the tests and benchmarks use this)."""
    drain_deletions()


# -- removal and links ------------------------------------------------------------------------------------------------
def remove(path: str) -> None:
    """Delete a checkpoint together with its ``.data`` file, or a checkpoint folder (a sharded checkpoint) whole;
    the blocks are freed later.

    All or nothing for a reader: the ``.ckpt`` goes first (renamed to a hidden name), so no reader ever finds a
    ``.ckpt`` without its ``.data``; a folder is renamed in one step, so no reader finds part of it. The renames are
    durable when this returns (a crash cannot bring the checkpoint back); what they hid is deleted on the background
    thread, or, after a crash, swept by the next save in the directory. A commit a dead writer left pending is
    completed first, so its new ``.ckpt`` cannot reappear.
    """
    path = os.path.abspath(path)
    hidden: list[str] = []
    with _WriterLock(os.path.dirname(path)) as lock:
        _recover_locked(path, lock)
        for victim in (path, data_path(path)):
            if os.path.lexists(victim):
                trash = _trash_name(victim)
                os.replace(victim, trash)
                hidden.append(trash)
        if hidden:
            lock.fsync()
    for trash in hidden:
        _UNLINKER.put(trash)


def link(target: str, linkpath: str) -> None:
    """Point ``linkpath`` at ``target`` (a relative symbolic link), and ``linkpath.data`` at its ``.data`` if any.

    The links are made under temporary names and committed like a save (journal included), so ``linkpath`` always
    resolves and our readers never pair one target's ``.ckpt`` with another's ``.data``.
    """
    linkpath = os.path.abspath(linkpath)
    directory = os.path.dirname(linkpath)
    with_data = os.path.exists(data_path(target))
    _check_names_fit(linkpath, with_data)
    token = _token()
    tmp_main = _hidden_name(linkpath, token, "tmp")
    tmp_data = _hidden_name(data_path(linkpath), token, "tmp") if with_data else None
    try:
        for source, tmp in ((target, tmp_main), (data_path(target), tmp_data)):
            if tmp is not None:
                os.symlink(os.path.relpath(os.path.abspath(source), directory), tmp)
    except BaseException:
        _discard(tmp_main, tmp_data)
        raise
    _commit_locked(linkpath, tmp_main, tmp_data)
