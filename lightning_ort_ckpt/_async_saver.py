"""The ordered background queue of asynchronous saves: one thread runs the plugin's file work (stage copies,
writes, deletions, links) in the order it was asked for, so nothing is deleted or linked before the file it depends
on is durable.

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
from collections.abc import Callable
from typing import Any

_STOP = object()


class BackgroundQueue:
    """One thread running submitted calls in order; the first error stops the ones queued after it (a staging copy
    queued after it is released with ``skipped()``), and is handed to the training thread by :meth:`take_error`."""

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
                elif hasattr(fn, "skipped"):  # a staging copy: release the optimizer steps waiting for it
                    fn.skipped()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._error = e
            finally:
                self._queue.task_done()

