"""The ordered background queue of asynchronous saves: one thread runs the plugin's file work (stage copies,
writes, deletions, links) in the order it was asked for, so nothing is deleted or linked before the file it depends
on is durable.

It lives exactly as long as its plugin uses it: :meth:`BackgroundQueue.close` (the plugin's ``teardown``) waits for
the queue, stops the thread and drops the ``atexit`` registration that otherwise finishes a save queued just before
the program ends.

A save that fails then has nobody left to raise it to, and the program would exit 0 as if it were stored. Python
gives a library no way to change the exit status at exit but ``os._exit``, which skips every exit handler still to
run; so the queue's handler runs first of all (:func:`_run_first_at_exit`), and on such a failure reports it on
stderr, runs every other exit handler (``atexit._run_exitfuncs``: logging, multiprocessing, temporary folders...),
flushes the standard streams and ends the process with status 1. Skipped are only the interpreter's own finalization
(objects still alive are not collected; a file the program left open and unflushed loses what it buffered) and
C-level exit handlers. A program that calls ``wait()`` (or lets ``fit`` end) gets the error as an exception instead
and decides.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

_STOP = object()
_hooked = False
_LIVE: set[BackgroundQueue] = set()  # queues not closed yet: their exit handlers are moved to the front at exit


class BackgroundQueue:
    """One thread running submitted calls in order; the first error stops the ones queued after it (a staging copy
    queued after it is released with ``skipped()``), and is handed to the training thread by :meth:`take_error`."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ort-ckpt-save", daemon=True)
        self._thread.start()
        _run_first_at_exit()
        _LIVE.add(self)
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
        _LIVE.discard(self)
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _at_exit(self) -> None:
        """Finish the queue; a failure nobody was told of ends the process with status 1, after every other exit
        handler ran (see the module's docstring)."""
        self.close()
        error = self.take_error()
        if error is None:
            return
        print(f"lightning-ort-ckpt: an asynchronous checkpoint save failed and was never reported "
              f"({type(error).__name__}): {error}\nlightning-ort-ckpt: exiting with status 1", file=sys.stderr)
        atexit._run_exitfuncs()  # the others, once each: this handler is unregistered and ran before any of them
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(1)

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
                elif hasattr(fn, "skipped"):  # a staging copy: release the optimizer steps waiting for it
                    fn.skipped()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
            finally:
                self._queue.task_done()


def _run_first_at_exit() -> None:
    """Once per process: when the main thread ends (``threading``'s exit hooks run before any ``atexit`` handler),
    register the live queues' handlers again, so that they run before every other handler."""
    global _hooked
    if not _hooked:
        _hooked = True
        with contextlib.suppress(AttributeError, RuntimeError):  # gone, or the process is exiting already
            threading._register_atexit(_to_the_front)  # type: ignore[attr-defined]  # private, since Python 3.9


def _to_the_front() -> None:
    for live in list(_LIVE):
        atexit.unregister(live._at_exit)
        atexit.register(live._at_exit)
