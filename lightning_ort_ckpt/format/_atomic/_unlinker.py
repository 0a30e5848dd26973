"""The background deletion of replaced and removed files: freeing gigabytes can take seconds on some disks, so a save
or removal only renames them away (``.<name>.<token>.old``) and one thread unlinks them, in order."""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import threading


class Unlinker:
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


UNLINKER = Unlinker()


def drain_deletions(timeout: float | None = None) -> bool:
    """Wait until the files saves and removals replaced or deleted are gone (they are unlinked on a background
    thread), so that no hidden ``.old`` file is left in the folder when training ends; False when ``timeout``
    seconds passed first."""
    return UNLINKER.join(timeout)


def wait_for_cleanup() -> None:
    """:func:`drain_deletions` without a time limit (the tests and benchmarks use this)."""
    drain_deletions()
