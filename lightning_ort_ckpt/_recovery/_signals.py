"""Saves asked for from inside a signal handler: never a wait on what the interrupted code holds, and durable
before the handler goes on.

Lightning's SLURM requeue handler (SIGUSR1 under ``SLURMEnvironment(auto_requeue=True)``) saves
``hpc_ckpt_N.ckpt`` from inside the handler, then requeues the job at once. A handler runs on the main thread
between two bytecodes of whatever it interrupted; where that was one of the plugin's own calls (a synchronous save
holding its directory's writer lock, a put holding the background queue's mutex), a save started in the handler
would wait for a lock its own thread holds, forever (Lightning #21406). :class:`Reentry` counts the plugin's calls
in progress on each thread: a save that arrives while one is in progress on its own thread runs as soon as that
call returns, on the same thread, before training runs another line (so with the tensors the signal found). A save
under Lightning's hpc name is made durable before the save returns (:func:`must_be_durable`): the job is requeued,
and killed, right after it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

_HPC_NAME = re.compile(r"^hpc_ckpt_\d+\.ckpt$")  # Lightning's name for the save of its requeue signal

F = TypeVar("F", bound=Callable[..., Any])


def must_be_durable(path: str) -> bool:
    """Whether the save of ``path`` is Lightning's save on the requeue signal: durable before it returns."""
    return bool(_HPC_NAME.match(os.path.basename(path)))


class Reentry:
    """The calls of one plugin in progress on each thread, and the saves that wait for them to return."""

    def __init__(self) -> None:
        self._local = threading.local()

    def busy(self) -> bool:
        """Whether this thread is inside one of the plugin's calls (a signal handler interrupted it there)."""
        return bool(getattr(self._local, "depth", 0))

    def later(self, save: Callable[[], Any]) -> None:
        """Run ``save`` once this thread's call in progress returns."""
        self._local.__dict__.setdefault("later", []).append(save)

    def call(self, run: Callable[[], Any], defer: bool) -> Any:
        """``run()`` as a call in progress; with ``defer``, one that arrives while another is in progress on this
        thread (a save in a signal handler) runs when that one returns (and returns None now)."""
        if defer and self.busy():
            self.later(lambda: self.call(run, defer))
            return None
        with self.inside():
            return run()

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            while not self._local.depth and getattr(self._local, "later", None):
                self._local.later.pop(0)()


def guarded(defer: bool) -> Callable[[F], F]:
    """A plugin method that counts as a call in progress (:class:`Reentry`, the plugin's ``_reentry``); with
    ``defer``, one that arrives while another is in progress on its thread (a save in a signal handler) runs when
    that one returns."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            reentry: Reentry = self._reentry
            return reentry.call(lambda: method(self, *args, **kwargs), defer)

        return call  # type: ignore[return-value]

    return wrap
