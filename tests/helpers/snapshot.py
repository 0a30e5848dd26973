"""A snapshot of the process state a plugin or callback of ours could change for the whole process (issue 40, point
1), taken in the test process (tests/conformance/test_nothing_global.py) and in each rank of a launched run
(tests/conformance/test_nothing_global_ranks.py): compare two with :func:`differences`."""

from __future__ import annotations

import atexit
import collections
import gc
import os
import signal
import sys
import threading
import types
import weakref
from typing import Any

from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ort_ckpt._lightning import _lightning_adapter

_CONNECTORS = ("pytorch_lightning.trainer.connectors.checkpoint_connector",
               "lightning.pytorch.trainer.connectors.checkpoint_connector")
_STRATEGY_METHODS = ("checkpoint_io", "save_checkpoint", "load_checkpoint", "remove_checkpoint", "teardown",
                     "process_dataloader")
_MODULE_HOOKS = ("_global_backward_hooks", "_global_backward_pre_hooks", "_global_buffer_registration_hooks",
                 "_global_forward_hooks", "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs",
                 "_global_forward_pre_hooks", "_global_module_registration_hooks",
                 "_global_parameter_registration_hooks")
_HOLD = "lightning_ort_ckpt._lightning._lightning_adapter.CheckpointIOAssignment.release"
STILL_GLOBAL = {f"{module}.{name}.checkpoint_io" for module, name in _lightning_adapter.STRATEGY_CLASSES} | {
    "weakref finalizers: holds of the checkpoint_io setter wrap"}
"""What is still wrapped while an ``OrtCheckpointIO`` the user made exists unbound, and the finalizer that unwraps
it once none does (issue 40, point 1a: deprecated, goes in 0.6)."""


def open_files() -> tuple[tuple[int, str], ...]:
    """The process's open file descriptors and what each points at (a file, a socket, a pipe)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append((int(fd), os.readlink(f"/proc/self/fd/{fd}")))
        except FileNotFoundError:  # the listing's own descriptor, closed since
            pass
    return tuple(sorted(found))


def exit_callbacks() -> tuple[str, ...]:
    """The Python functions registered with ``atexit``, in the order they would run: nothing lists them, so a forked
    child runs them (``atexit._run_exitfuncs``, its output to /dev/null, 60 s at most) and names each one called."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            signal.alarm(60)
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            here, called = sys._getframe(), []

            def profile(frame: Any, event: str, arg: Any) -> None:
                if event == "call" and frame.f_back is here:
                    called.append(f"{frame.f_globals.get('__name__')}.{frame.f_code.co_qualname}")

            sys.setprofile(profile)
            atexit._run_exitfuncs()
            sys.setprofile(None)
            os.write(write, "\n".join(called).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as reader:
        names = reader.read()
    os.waitpid(pid, 0)
    return tuple(names.split("\n")) if names else ()


def snapshot() -> dict[str, Any]:
    """Everything of Lightning's, torch's and the interpreter's that a plugin or callback of ours could change for
    the whole process, by name: callables and classes compared by identity, registries by their entries."""
    import torch.nn.modules.module as module_hooks
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    state: dict[str, Any] = {}
    for module_name, name in _lightning_adapter.STRATEGY_CLASSES:
        cls = getattr(sys.modules.get(module_name), name, None)
        for attr in _STRATEGY_METHODS:
            state[f"{module_name}.{name}.{attr}"] = cls.__dict__.get(attr) if cls is not None else None
    for module_name in _CONNECTORS:
        connector = getattr(sys.modules.get(module_name), "_CheckpointConnector", None)
        state[f"{module_name}._parse_ckpt_path"] = connector.__dict__.get("_parse_ckpt_path") if connector else None
    for module_name, attr in _lightning_adapter.LOADER_BINDINGS:
        state[f"{module_name}.{attr}"] = getattr(sys.modules.get(module_name), attr, None)
    state["DataLoader._get_iterator"] = DataLoader.__dict__["_get_iterator"]
    state["ModelCheckpoint._find_last_checkpoints"] = ModelCheckpoint.__dict__["_find_last_checkpoints"]
    state["torch global optimizer pre-hooks"] = tuple(_global_optimizer_pre_hooks.values())
    state["torch global optimizer post-hooks"] = tuple(_global_optimizer_post_hooks.values())
    for name in _MODULE_HOOKS:
        state[f"torch.nn.modules.module.{name}"] = tuple(getattr(module_hooks, name).items())
    state["torch.nn.modules.module._global_is_full_backward_hook"] = module_hooks._global_is_full_backward_hook
    state["threads"] = tuple(sorted((t.ident or 0, t.name) for t in threading.enumerate() if t.is_alive()))
    state["atexit callbacks"] = exit_callbacks()
    state["threading's exit callbacks"] = tuple(threading._threading_atexits)  # type: ignore[attr-defined]
    finalizers = sorted(_name(f.peek()[1]) for f in list(weakref.finalize._registry)  # type: ignore[attr-defined]
                        if f.peek() is not None)
    state["weakref finalizers"] = tuple(name for name in finalizers if name != _HOLD)
    state["weakref finalizers: holds of the checkpoint_io setter wrap"] = finalizers.count(_HOLD)
    state["open files"] = open_files()
    state["signal handlers"] = tuple((s.name, signal.getsignal(s)) for s in signal.valid_signals()
                                     if isinstance(s, signal.Signals))
    state["sys.excepthook"], state["threading.excepthook"] = sys.excepthook, threading.excepthook
    state["sys trace and profile"] = (sys.gettrace(), sys.getprofile())
    return state


def differences(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """The names whose values differ: by identity, or entry by entry (each by identity or equality) for tuples."""
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, tuple) and isinstance(b, tuple):
            return len(a) == len(b) and all(same(x, y) or x == y for x, y in zip(a, b))
        return a is b or (isinstance(a, (int, str)) and a == b)

    return {key for key in before.keys() | after.keys() if not same(before.get(key), after.get(key))}


def described(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The differences with both values, as text (for a failing assertion or a rank's record)."""
    def text(a: Any, b: Any) -> tuple[str, str]:
        if isinstance(a, tuple) and isinstance(b, tuple):  # what went, what came
            return repr([x for x in a if x not in b])[:600], repr([x for x in b if x not in a])[:600]
        return repr(a)[:600], repr(b)[:600]

    return {key: text(before.get(key), after.get(key)) for key in differences(before, after)}


def cyclic_garbage() -> list[Any]:
    """What only the garbage collector would free now (a collection that keeps it in ``gc.garbage``, then empties
    that): the objects on reference cycles and what hangs from them."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = list(gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    return found  # (kept, not freed: a collection frees it once the caller lets go of it)


def cycle_through(start: Any, among: list[Any]) -> list[Any] | None:
    """A shortest chain of references from ``start`` back to itself through objects of ``among``, or None."""
    inside = {id(o) for o in among}
    came_from: dict[int, Any] = {}
    frontier = collections.deque()
    for first in gc.get_referents(start):
        if id(first) in inside and id(first) not in came_from:
            came_from[id(first)] = None
            frontier.append(first)
    while frontier:
        here = frontier.popleft()
        if here is start:
            chain = [here]
            while came_from[id(chain[-1])] is not None:
                chain.append(came_from[id(chain[-1])])
            return [start, *reversed(chain)]
        for nxt in gc.get_referents(here):
            if id(nxt) in inside and id(nxt) not in came_from:
                came_from[id(nxt)] = here
                frontier.append(nxt)
    return None


def ours_on_cycles(among: list[Any]) -> dict[str, list[str]]:
    """Each class of ours with an instance on a reference cycle within ``among``: the cycle, as type names."""
    found: dict[str, list[str]] = {}
    for o in among:
        name = f"{type(o).__module__}.{type(o).__qualname__}"
        if name.startswith("lightning_ort_ckpt.") and name not in found:
            chain = cycle_through(o, among)
            if chain is not None:
                found[name] = [_label(x) for x in chain]
    return found


def _name(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', type(function).__qualname__)}"


def _label(o: Any) -> str:
    if isinstance(o, types.MethodType):
        return f"bound method {o.__func__.__qualname__}"
    if isinstance(o, types.FunctionType):
        return f"function {o.__qualname__}"
    return type(o).__qualname__
