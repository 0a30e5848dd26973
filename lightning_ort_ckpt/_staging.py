"""Staging for asynchronous saves: copies of a checkpoint's tensors that training cannot change, made out of its way.

An asynchronous save must own the bytes it writes, because training changes its tensors as soon as the save call
returns. :class:`Stager` makes those copies with three rules:

- **Bounded**: the plugin stages a save only once the previous one is written (``OrtCheckpointIO`` waits for it),
  so one checkpoint's worth of staging memory exists at a time and saves never pile up: saves asked for faster than
  the disk writes them take the disk's pace, as synchronous saves would.
- **Reused memory**: each save copies into the previous save's buffers. A copy into memory already touched runs at
  memcpy speed; into fresh memory it pays a page fault per page, which on VMs is slower than the disk.
- **Out of the training thread's way**: tensors that only an optimizer step changes (the parameters the optimizers
  hold, and the optimizers' state) are copied on the writer thread while training runs its next forward and
  backward pass; every optimizer step in the process waits for that copy before it updates anything (a torch
  step pre-hook; for a step given a closure, as Lightning steps, after the closure's forward and backward). Buffers,
  which a forward pass may update, and everything else are copied before the save call returns. If a deferred
  tensor is changed in place before its copy is done anyway (in-place edits outside ``optimizer.step``, seen by
  torch's version counter), the save fails loudly instead of writing a mix of two steps.

Frozen parameters unchanged since the previous save call, which a save will most likely not write at all (their
``.data`` is linked: see ``sharing``), are not copied: the plugin names them in ``keep``.

A save that follows another with no optimizer step in between (``last.ckpt`` right after the top-k file of the
same step) reuses the first save's copies of every tensor whose version is unchanged, instead of copying again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .errors import CheckpointSaveError
from .format import CheckpointContents, OptimizerGroup, StoredAs

_lock = threading.Lock()
_pending: set[_Copy] = set()  # deferred copies not finished yet, across every plugin of the process
_steps = 0  # optimizer steps taken in this process while the hook was installed


def _before_optimizer_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """torch's global step pre-hook: no optimizer changes a parameter while a copy of it is still being made.

    A step given a closure (Lightning's automatic optimization: the closure runs forward and backward inside
    ``step``) gets the closure wrapped, so the wait comes after the forward and backward pass, right before the
    update; a step without one waits here (its forward and backward pass ran before the call).
    """
    global _steps
    _steps += 1
    if not _pending:
        return None
    # torch passes the step's own arguments with the optimizer first: (optimizer, closure?) or closure=...
    closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
    if not callable(closure):
        _wait_for_copies()
        return None

    def closure_then_wait(*a: Any, **k: Any) -> Any:
        result = closure(*a, **k)
        _wait_for_copies()
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_wait}
    return (args[0], closure_then_wait, *args[2:]), kwargs


def _wait_for_copies() -> None:
    with _lock:
        copies = list(_pending)
    for copy in copies:
        copy.done.wait()


class _StepHook:
    """torch's global optimizer step pre-hook, installed while at least one :class:`Stager` uses it: a plugin's
    ``teardown`` closes its stager, and the last one to close removes the hook."""

    def __init__(self) -> None:
        self._users = 0
        self._handle: Any = None

    def acquire(self) -> None:
        with _lock:
            self._users += 1
            if self._handle is None:
                self._handle = register_optimizer_step_pre_hook(_before_optimizer_step)

    def release(self) -> None:
        with _lock:
            self._users -= 1
            if self._users == 0 and self._handle is not None:
                self._handle.remove()
                self._handle = None


_HOOK = _StepHook()


@dataclass(eq=False)
class _Copy:
    """Copies of tensors to make later, on the writer thread; ``done`` is set when they are made (or failed)."""

    path: str
    items: list[tuple[str, torch.Tensor, torch.Tensor, int]] = field(default_factory=list)  # name, source, dest, version
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self) -> None:
        try:
            for _, source, dest, _ in self.items:
                dest.copy_(source.detach())
            changed = [name for name, source, _, version in self.items if source._version != version]
            if changed:
                raise CheckpointSaveError(
                    f"{changed[0]!r} ({len(changed)} tensor(s) in all) was changed in place while its asynchronous "
                    "save was copying it (outside optimizer.step, which waits for the copy); the file would mix two "
                    "training steps, so it was not written. Save synchronously, or make the change after the save "
                    "is durable (checkpoint_io.wait())", self.path)
        finally:
            self.skipped()

    def skipped(self) -> None:
        """Release the optimizer steps waiting for this copy (the writer calls this when an earlier error stops
        it from running the copy at all)."""
        with _lock:
            _pending.discard(self)
        self.done.set()


class Stager:
    """The staging memory of one plugin, reused from save to save."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # what each buffer holds a copy of, for tensors of the live module or optimizers: the source tensor (held, so
        # its memory cannot be freed and handed to another tensor meanwhile), its version and the step count then
        self._sources: dict[str, tuple[torch.Tensor, int, int]] = {}
        self._hooked = False

    def close(self) -> None:
        """Free the staging memory and stop holding the optimizer step hook (once every save is written)."""
        self._buffers, self._sources = {}, {}
        if self._hooked:
            self._hooked = False
            _HOOK.release()

    def stage(self, ck: CheckpointContents, path: str, deferrable: Iterable[torch.Tensor], live: Iterable[torch.Tensor],
              wait_for_buffers: Callable[[], None], keep: Collection[str] = ()) -> tuple[CheckpointContents, _Copy]:
        """``ck`` with every tensor replaced by a buffer of its own.

        Tensors that share memory with ``deferrable`` (parameters the optimizers hold, and their state) are copied
        by the returned job (run it on the writer thread, before the write); all others now. A tensor of ``live``
        (the module's parameters and buffers, and ``deferrable``) unchanged since the previous save, with no
        optimizer step since, reuses that save's copy. ``wait_for_buffers`` is called before the first copy into
        memory that an earlier save may still be writing from: a save that reuses every copy waits for nothing.
        Frozen tensors named in ``keep`` stay the live ones, uncopied (``sharing``: unchanged frozen tensors that the
        save will most likely not write at all)."""
        if not self._hooked:
            _HOOK.acquire()
            self._hooked = True
        defer = {t.data_ptr() for t in deferrable if t.device.type == "cpu"}
        live_memory = defer | {t.data_ptr() for t in live}
        job = _Copy(path)
        buffers, self._buffers = self._buffers, {}
        sources, self._sources = self._sources, {}
        waited = False

        def copy_(where: str, t: Any) -> Any:
            nonlocal waited
            if isinstance(t, StoredAs):  # staged as it is (the narrow type), converted as it is written
                return StoredAs(copy_(where, t.tensor), t.dtype)
            if not isinstance(t, torch.Tensor):
                return t
            buffer = buffers.get(where)
            fits = buffer is not None and buffer.shape == t.shape and buffer.dtype == t.dtype
            previous = sources.get(where)
            if not (fits and previous is not None and previous[0].data_ptr() == t.data_ptr()
                    and previous[0].device == t.device and previous[1:] == (t._version, _steps)):
                if not fits:
                    buffer = torch.empty(t.shape, dtype=t.dtype)
                elif not waited:
                    wait_for_buffers()
                    waited = True
                if t.data_ptr() in defer:
                    job.items.append((where, t, buffer, t._version))
                else:
                    buffer.copy_(t.detach())
            # else: unchanged since the last save copied it, with no optimizer step since: reuse that copy
            if t.data_ptr() in live_memory:
                self._sources[where] = (t, t._version, _steps)
            self._buffers[where] = buffer
            return buffer

        staged = CheckpointContents(
            trainable={n: copy_(n, t) for n, t in ck.trainable.items()},
            frozen={n: t if n in keep else copy_(n, t) for n, t in ck.frozen.items()},
            optimizer_groups={g: OptimizerGroup(grp.step, grp.initial_learning_rate,
                                                {p: {m: copy_(f"{g}/{p}/{m}", t) for m, t in ms.items()}
                                                 for p, ms in grp.states.items()})
                              for g, grp in ck.optimizer_groups.items()},
            properties=dict(ck.properties), nominal=ck.nominal)
        if job.items:
            with _lock:
                _pending.add(job)
        else:
            job.done.set()
        return staged, job


def optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The tensors only ``optimizer.step`` changes: the parameters the optimizers hold, and their state."""
    out: list[torch.Tensor] = []
    for opt in optimizers:
        out += [p for group in opt.param_groups for p in group["params"]]
        out += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out
