"""Where the plugin's file work runs, chosen once when the plugin is made: :class:`InlineSaves` (on the training
thread, at once) or :class:`BackgroundSaves` (``async_save=True``: the tensors are copied off training's memory by a
``_staging.Stager``, then one thread runs the file work, stage copies, writes, deletions and links, in the order it
was asked for, so nothing is deleted or linked before the file it depends on is durable: the
:class:`BackgroundQueue`). Both are :class:`SaveExecutor`.

A save to a memory file system (``/dev/shm``: ``Store.in_memory``, a fast tier's usual place) is written from the
live tensors that only an optimizer step changes (``direct``): on CPU that skips a copy of the whole state per save,
and its memory, and the next step waits until the write has read them (the writer calls the save's
:attr:`Owned.when_read`), which there runs at memory speed, under that step's forward and backward pass. A save
anywhere else is staged: a disk's writes, once the kernel's dirty-page limit is reached, and an upload run at the
device's or network's speed, which the training steps must not wait for.

It lives exactly as long as its plugin uses it: :meth:`BackgroundQueue.close` (the plugin's ``teardown``) waits for
the queue, stops the thread and drops the ``atexit`` registration that otherwise finishes a save queued just before
the program ends.

A save that fails then has nobody left to raise it to: it is reported on stderr, naming the checkpoint. The exit
status stays the program's: a library can change it at exit only with ``os._exit``, which would skip the exit
handlers of everything else and the interpreter's own clean-up. A program that must act on a failed save calls
``wait()`` (or lets ``fit`` end), which raises it.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Iterable
from typing import Any, NamedTuple, Protocol

from . import _staging
from ..format import CheckpointContents

_STOP = object()


class BackgroundQueue:
    """One thread running submitted calls in order; the first error stops the ones queued after it, and is handed
    to the training thread by :meth:`take_error`. A call or argument with ``skipped()`` (a staging job, which
    optimizer steps may wait for) is released by it once the call ended, or was skipped."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ort-ckpt-save", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._queue.put((fn, args, kwargs))

    def join(self) -> None:
        """Block until everything submitted so far has run."""
        self._queue.join()

    def busy(self) -> bool:
        """Whether anything submitted has not finished yet."""
        return self._queue.unfinished_tasks > 0

    def take_error(self) -> BaseException | None:
        error, self._error = self._error, None
        return error

    def close(self) -> None:
        """Run what is queued, then stop the thread; an error not taken yet stays for :meth:`take_error`."""
        atexit.unregister(self._at_exit)
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _at_exit(self) -> None:
        """Finish the queue; report on stderr a failure nobody was told of (see the module's docstring)."""
        self.close()
        error = self.take_error()
        if error is not None:
            print(f"lightning-ort-ckpt: an asynchronous checkpoint save failed and was never reported "
                  f"({type(error).__name__}): {error}", file=sys.stderr)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            fn, args, kwargs = item
            try:
                if self._error is None:
                    fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
            finally:
                for held in (fn, *args):  # a staging job: release the optimizer steps waiting for it, whatever
                    if isinstance(held, _staging.Job):
                        held.skipped()
                self._queue.task_done()



Sources = Callable[[], "tuple[list[Any], list[Any]] | None"]
"""What a save will stage (the module's tensors, the optimizers), or None where it is not known (``Stager.prepare``)."""


class Owned(NamedTuple):
    """A save's contents as the write may read them (:meth:`SaveExecutor.own`)."""

    contents: CheckpointContents
    keep: Collection[str]  # the frozen tensors left as the live ones (``_sharing``)
    when_read: Callable[[], None] | None  # for the write to call once it has read the tensors (``direct``)


class SaveExecutor(Protocol):
    """How the plugin runs a save and the file work around it."""

    def own(self, contents: CheckpointContents, path: str, deferrable: Iterable[Any], live: Iterable[Any],
            wait: Callable[[], None], keep: Collection[str], direct: bool = False) -> Owned:
        """``contents`` in memory that training does not change until the file is written (``direct``: or until
        the write calls ``when_read``), and the frozen tensors of ``keep`` left as the live ones (``_sharing``)."""

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` after everything run before it."""

    def prepare(self, sources: Sources) -> None:
        """Get ready, ahead of the first save, for saves of ``sources``."""

    def arm(self, optimizers: list[Any]) -> None:
        """The fit's ``optimizers`` exist: the preparation waits for their first steps."""

    def join(self) -> None:
        """Return once everything run so far has finished."""

    def take_error(self) -> BaseException | None:
        """The first error of work that ran out of the caller's sight, once."""

    def close(self) -> BaseException | None:
        """Finish everything, let go of threads and memory; the error not taken yet."""


class InlineSaves:
    """Everything at once, on the caller's thread: a save returns once its file is stored, so it needs no copy and
    no error is ever left for later."""

    def own(self, contents: CheckpointContents, path: str, deferrable: Iterable[Any], live: Iterable[Any],
            wait: Callable[[], None], keep: Collection[str], direct: bool = False) -> Owned:
        return Owned(contents, frozenset(), None)

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def prepare(self, sources: Sources) -> None:
        pass

    def arm(self, optimizers: list[Any]) -> None:
        pass

    def join(self) -> None:
        pass

    def take_error(self) -> BaseException | None:
        return None

    def close(self) -> BaseException | None:
        return None


class BackgroundSaves:
    """Staged copies, and a :class:`BackgroundQueue` started at the first use and stopped by :meth:`close` (the
    plugin's ``teardown``; a later save starts another)."""

    def __init__(self) -> None:
        self._queue: BackgroundQueue | None = None
        self._stager = _staging.Stager()  # staging memory, reused from save to save
        self._sources: Sources | None = None  # what saves stage, given by prepare

    def own(self, contents: CheckpointContents, path: str, deferrable: Iterable[Any], live: Iterable[Any],
            wait: Callable[[], None], keep: Collection[str], direct: bool = False) -> Owned:
        """Staged copies; those of ``deferrable`` that the optimizers of ``prepare``'s sources hold wait for the
        writer thread, and only those optimizers' steps wait for them (without sources, everything is copied now).
        ``direct``: those on CPU are not copied; the steps wait for the write to read them (``when_read``)."""
        found = self._sources() if self._sources is not None else None
        staged, later = self._stager.stage(contents, path, deferrable, live, wait, keep,
                                           found[1] if found is not None else (), direct)
        if direct:
            return Owned(staged, keep, later)  # the write runs it (the queue releases it, whatever happens)
        self.run(later)  # the copies an optimizer step waits for, first on the thread
        return Owned(staged, keep, None)

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._queue is None:
            self._queue = BackgroundQueue()
        self._queue.submit(fn, *args)

    def prepare(self, sources: Sources) -> None:
        """The staging memory, and the writer thread, ready ahead of the first save: both from the first optimizer
        step that finds ``sources`` (while saves are asynchronous)."""

        self._sources = sources
        saves = weakref.ref(self)  # held by the stager's memory, which this holds: weakly, or a reference cycle

        def found() -> tuple[list[Any], list[Any]] | None:
            what, owner = sources(), saves()
            if what is not None and owner is not None and owner._queue is None:
                owner._queue = BackgroundQueue()
            return what

        self._stager.prepare(found)

    def arm(self, optimizers: list[Any]) -> None:
        """The fit's ``optimizers`` exist: the staging memory waits for their first steps (``_staging_memory``)."""
        self._stager.arm(optimizers)

    def join(self) -> None:
        if self._queue is not None:
            self._queue.join()

    def take_error(self) -> BaseException | None:
        return self._queue.take_error() if self._queue is not None else None

    def close(self) -> BaseException | None:
        queue_, self._queue = self._queue, None
        if queue_ is not None:
            queue_.close()
        self._stager.close()
        return queue_.take_error() if queue_ is not None else None
