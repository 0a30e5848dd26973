"""What is deleted later, away from the saves: replaced and removed files (renamed away as ``.<name>.<token>.old``:
freeing gigabytes can take seconds on some disks) are unlinked in order by one thread (:class:`Unlinker`), but for
the newest large one of each directory, kept as that directory's spare for its next save to write over (freeing
pages and allocating as many again cost a memory file system more than the copy itself: docs/performance.md, "The
fast tier"), and what
dead saves left in a directory is swept (:func:`sweep_stale`): temporaries of interrupted saves, and replaced or
removed files a process was killed before unlinking. Only this host's leftovers of a dead process or an earlier boot
are certain; others' (and names of older versions) go only once older than :data:`STALE_AGE_S`, so a shared file
system never loses another machine's save in progress. A process lists a directory once (its first save there); later
saves look again only at the leftovers that had to wait."""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import signal
import stat
import threading
import time
from collections.abc import Callable

from .._platform import portable_io
from ._names import LEFTOVER, OLD_LEFTOVER, dead

try:
    import fcntl
except ImportError:  # Windows: no leases, so no spares
    fcntl = None  # type: ignore[assignment]

SPARE_MIN_BYTES = 1 << 20  # a smaller retired file is deleted at once: writing over it saves nothing worth a spare


class Unlinker:
    """One daemon thread that deletes files in the order they were queued, running only while files are queued: it
    starts with the first, ends when the queue is empty, and is registered with ``atexit`` (to delete what is left
    at exit) only meanwhile or while it keeps spares, so importing the package starts and registers nothing. A forked
    child starts with a queue of its own (:meth:`_this_process`): no at-fork handler is registered for it.

    Spares: while someone saves often and will let go (:meth:`keep_spares`: a plugin, from its first save to its
    teardown), a retired regular file of one link and at least ``SPARE_MIN_BYTES`` is not deleted but kept, one per
    directory (a newer one replaces it), until the next save there takes it (:meth:`take`), the last keeper lets go
    or :meth:`join` deletes it. A directory thus holds at most the files it held while a save was being written;
    between saves, one more. A save nobody keeps spares for (a single call) leaves none."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._queue: queue.Queue[str] = queue.Queue()
        self._thread: threading.Thread | None = None  # the running thread, while files are queued
        self._started: threading.Thread | None = None  # the last one started: it may still be returning
        self._lock = threading.Lock()
        self._spares: dict[str, str] = {}  # directory -> a retired file its next save may write over
        self._keepers = 0  # holders of :meth:`keep_spares`: spares are kept only while there is one
        self._exit_hook = False  # whether ``drain`` is registered with atexit

    def _this_process(self) -> None:
        """In a forked child, a fresh queue: the parent's thread does not run here, and its locks may be held by
        threads the child does not have."""
        if self._pid != os.getpid():
            self._reset()

    def put(self, path: str) -> None:
        """Delete ``path`` later, or keep it as its directory's spare (the class's doc)."""
        self._this_process()
        spare = _may_be_spare(path)
        with self._lock:
            if spare and self._keepers:  # kept; the spare it replaces is deleted instead
                directory = os.path.dirname(os.path.abspath(path))
                path, self._spares[directory] = self._spares.get(directory, ""), path
            if path:
                self._delete_later(path)
            self._hook_exit()

    def keep_spares(self) -> Callable[[], None]:
        """Keep spares until the returned function is called (once; the last holder's call deletes them)."""
        self._this_process()
        with self._lock:
            self._keepers += 1
        pid, held = os.getpid(), [True]

        def let_go() -> None:
            if not held or pid != os.getpid():  # once; and never a forked child's for its parent's hold
                return
            held.clear()
            with self._lock:
                self._keepers = max(0, self._keepers - 1)
                last = not self._keepers
            if last:
                self._release_spares()

        return let_go

    def take(self, directory: str, into: str) -> int | None:
        """Rename ``directory``'s spare to ``into`` (a save's temporary, to write over) and return its size; None
        where there is none, or where it is in use: open or mapped by any process (a write lease is refused), so
        that a reader of the checkpoint it was keeps reading what was saved (it is then deleted as usual)."""
        self._this_process()
        with self._lock:
            spare = self._spares.pop(os.path.abspath(directory), None)
            self._hook_exit()
        if spare is None:
            return None
        size = _unused_size(spare)
        if size is not None:
            try:
                os.rename(spare, into)
                return size
            except OSError:
                pass
        with self._lock:
            self._delete_later(spare)
            self._hook_exit()
        return None

    def _delete_later(self, path: str) -> None:
        """Queue ``path``, starting the thread if none runs (the caller holds the lock)."""
        self._queue.put(path)
        if self._thread is None:
            self._thread = self._started = threading.Thread(target=self._run, name="ort-ckpt-unlink", daemon=True)
            self._thread.start()

    def _hook_exit(self) -> None:
        """``drain`` registered with atexit exactly while the thread runs or spares are kept (the caller holds the
        lock)."""
        wanted = self._thread is not None or bool(self._spares)
        if wanted != self._exit_hook:
            (atexit.register if wanted else atexit.unregister)(self.drain)
            self._exit_hook = wanted

    def _release_spares(self) -> None:
        with self._lock:
            spares, self._spares = self._spares, {}
            for path in spares.values():
                self._delete_later(path)
            self._hook_exit()

    def join(self, timeout: float | None = None) -> bool:
        """Delete the spares too; wait until every queued file is deleted and the thread has ended (it ends as the
        queue empties); False when ``timeout`` seconds passed first."""
        self._this_process()
        self._release_spares()
        done = self._queue.all_tasks_done
        with done:
            if not done.wait_for(lambda: not self._queue.unfinished_tasks, timeout):
                return False
        with self._lock:
            thread = self._started  # (``_thread`` is cleared by the thread itself before it has returned)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def drain(self) -> None:
        """Delete what is still queued on the calling thread too, and wait for the one being deleted and for the
        thread to end (no thread of ours runs while the interpreter finalizes)."""
        self._this_process()
        self._release_spares()
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
                except queue.Empty:  # nothing left: the thread (and its atexit registration, without spares) end
                    self._thread = None
                    self._hook_exit()
                    return
            self._unlink(path)

    def _unlink(self, path: str) -> None:
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):  # a removed sharded checkpoint: all of it
                shutil.rmtree(path)
            else:
                os.unlink(path)
        self._queue.task_done()


def _may_be_spare(path: str) -> bool:
    """Whether a retired ``path`` may be kept as a spare: a regular file of one link, large enough, that its owner
    (this process's user) may write; never on the portable path."""
    if fcntl is None or not hasattr(fcntl, "F_SETLEASE") or portable_io():
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size >= SPARE_MIN_BYTES
            and st.st_uid == os.geteuid() and bool(st.st_mode & stat.S_IWUSR))


def _unused_size(path: str) -> int | None:
    """The size of ``path`` if it is still a spare to write over (as :func:`_may_be_spare`) and no process has it
    open or mapped: a write lease is granted only then. It is let go at once; a reader opening it meanwhile would
    signal this process, with SIGURG (ignored by default) rather than SIGIO (which ends it)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not _may_be_spare(path) or not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return os.fstat(fd).st_size
    except OSError:  # EAGAIN: open elsewhere; leases off (fs.leases-enable), or a file system without them
        return None
    finally:
        os.close(fd)


UNLINKER = Unlinker()


def drain_deletions(timeout: float | None = None) -> bool:
    """Wait until the files saves and removals replaced or deleted are gone (they are unlinked on a background
    thread), so that no hidden ``.old`` file is left in the folder when training ends; False when ``timeout``
    seconds passed first."""
    return UNLINKER.join(timeout)


def keep_spares() -> Callable[[], None]:
    """:meth:`Unlinker.keep_spares` of this process's unlinker."""
    return UNLINKER.keep_spares()


def wait_for_cleanup() -> None:
    """:func:`drain_deletions` without a time limit (the tests and benchmarks use this)."""
    drain_deletions()


STALE_AGE_S = 7 * 24 * 3600  # leftovers of other hosts, or named as older versions did, go only after this long

_Sweeps = tuple[threading.Lock, dict[str, set[str]]]
_SWEEPS: dict[int, _Sweeps] = {}  # by process: a lock, and each directory it listed -> the leftovers that had to wait


def _sweeps() -> _Sweeps:
    """This process's lock and listings. A forked child makes its own (its parent's lock may be held by a thread
    the child does not have), so no at-fork handler is registered, at import or later."""
    pid = os.getpid()
    found = _SWEEPS.get(pid)
    return found if found is not None else _SWEEPS.setdefault(pid, (threading.Lock(), {}))


def sweep_stale(directory: str, *, relist: bool = False) -> None:
    """Queue for deletion what dead saves left in ``directory``.

    The directory is listed once per process (or with ``relist``): a directory of many files costs one listing per
    run, not one per save. Later calls look again only at the leftovers that listing found and had to leave (a live
    writer's, another host's, recent ones of older versions)."""
    now = time.time()
    lock, waiting = _sweeps()
    with lock:
        names = None if relist else waiting.get(directory)
        if names is None:
            with os.scandir(directory) as entries:
                names = {e.name for e in entries if LEFTOVER.match(e.name) or OLD_LEFTOVER.match(e.name)}
        waiting[directory] = {name for name in names if not _swept(os.path.join(directory, name), now)}


def _swept(path: str, now: float) -> bool:
    """Queue the leftover ``path`` for deletion if its save is certainly dead; True when it is queued or gone."""
    try:
        st = os.lstat(path)
    except OSError:
        return True
    m = LEFTOVER.match(os.path.basename(path))
    gone = dead(m) if m is not None else None
    if gone is None:  # we cannot tell: only by age
        gone = now - max(st.st_mtime, st.st_ctime) > STALE_AGE_S
    if gone:
        UNLINKER.put(path)
    return gone


def forget_listing(directory: str) -> None:
    """Have the next save list ``directory`` again (a writer died there during this run)."""
    lock, waiting = _sweeps()
    with lock:
        waiting.pop(directory, None)
