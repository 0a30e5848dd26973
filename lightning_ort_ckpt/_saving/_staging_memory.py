"""The staging memory of asynchronous saves, the part every layout shares: buffers reused from save to save,
allocated ahead of the first one, let go at ``close``.

- **Allocated ahead**: :meth:`StagingMemory.prepare` names what a save will stage; once the fit's optimizers exist
  (its training data is set up), :meth:`StagingMemory.arm` puts a step post-hook on each of them, and once every one
  has taken its first step (Adam makes its state in its first step) the first save's buffers are allocated (and
  touched) on a thread of its own, so a save every N steps finds them ready (:meth:`StagingMemory.ready`);
  :meth:`StagingMemory.prepare_keys` allocates them for given keys at once (``dcp.async_save`` users).
- **Reused, bounded**: each save takes (:meth:`StagingMemory.take`) the previous save's buffer of the same key and
  shape, else one allocated ahead of the same shape, else a new one; what it does not take is let go before it
  allocates what it lacks, so one copy of the state exists at a time.
- **Hooks on the fit's own optimizers, removed where torch does not iterate them**: never torch's global registry.
  A hook never removes itself (torch is iterating over the optimizer's hooks while it calls it): once it has
  started the allocation it does nothing, and the next :meth:`take` or :meth:`close` (the plugin's teardown)
  removes them all.

How a buffer is made (pinned, one block, carved) and what is copied into it is the layout's (``_staging``: a
module's tensors; ``_dcp_staging``: each rank's shards), given as ``allocate`` and ``spec``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

Spec = tuple[tuple[int, ...], torch.dtype, bool]  # shape, dtype, pinned: what a staging buffer must be to hold a copy
Found = tuple[list[torch.Tensor], list[torch.optim.Optimizer]]  # what a save will stage: tensors, optimizers
Sources = Callable[[], "Found | None"]
Allocate = Callable[[list[Spec], bool], list[torch.Tensor]]  # buffers for specs, touched (faulted in) or not


class StagingMemory:
    """The buffers of one stager, by key, and those allocated ahead of the first save, by spec."""

    def __init__(self, allocate: Allocate, spec: Callable[[torch.Tensor], Spec], thread_name: str) -> None:
        self.buffers: dict[str, tuple[Spec, torch.Tensor]] = {}
        self.spares: dict[Spec, list[torch.Tensor]] = {}  # allocated ahead, not taken by a save yet
        self.allocate = allocate
        self.spec = spec
        self._thread_name = thread_name
        self._preparing: threading.Thread | None = None
        self._sources: tuple[Sources, Callable[[], object]] | None = None  # what ``prepare`` named
        self._hooks: list[Any] = []  # the step post-hooks of ``arm`` on the optimizers, removed at take or close
        self._started = False  # the hooks have started the allocation: they do nothing more

    def ready(self) -> bool:
        """Whether the next save finds memory to copy into (allocated ahead, or the previous save's), without
        waiting for an allocation still running."""
        return (self._preparing is None or not self._preparing.is_alive()) and bool(self.spares or self.buffers)

    def prepare(self, sources: Sources, first: Callable[[], object] = lambda: None) -> None:
        """What a save will stage: ``sources()`` names the tensors and the optimizers (None while saves are
        synchronous); ``first`` is called before the allocation :meth:`arm` starts. Registers nothing."""
        self._sources = (sources, first)

    def arm(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Put a step post-hook on each of the fit's ``optimizers`` (once it made them): after every optimizer
        ``sources()`` names has stepped once (while it names any: saves may turn asynchronous midway), call
        ``first`` and allocate, on a thread, buffers for the tensors and the optimizers' state, unless a save came
        first. Nothing before :meth:`prepare`, nor while armed, started or holding buffers already."""
        if self._sources is None or self._hooks or self._started or self.buffers:
            return
        sources, first = self._sources
        stepped: set[int] = set()

        def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if self._started:
                return
            stepped.add(id(optimizer))
            found = sources()
            if found is None or not all(id(o) in stepped for o in found[1]):
                return
            self._started = True
            first()
            if self.buffers:  # a save came first: it allocated its buffers
                return
            tensors, optimizers = found
            self._start(self._allocate_spares, [self.spec(t) for t in [*tensors, *state_tensors(optimizers)]])

        self._hooks = [optimizer.register_step_post_hook(after_step) for optimizer in optimizers]

    def prepare_keys(self, specs: dict[str, Spec]) -> None:
        """Allocate (and touch) on a thread a buffer for each key of ``specs`` that has none yet, for the first save
        of that state to take."""
        self.join()  # an allocation still running: its keys have memory already
        self._start(self._allocate_keyed, {key: spec for key, spec in specs.items() if key not in self.buffers})

    def _start(self, target: Callable[[Any], None], specs: Any) -> None:
        self.join()
        self._preparing = threading.Thread(target=target, args=(specs,), name=self._thread_name, daemon=True)
        self._preparing.start()

    def _allocate_spares(self, specs: list[Spec]) -> None:
        spares: dict[Spec, list[torch.Tensor]] = {}
        try:
            buffers = self.allocate(specs, True)
        except (MemoryError, RuntimeError):  # out of memory: the first save allocates, and reports it, itself
            return
        for spec, buffer in zip(specs, buffers):
            spares.setdefault(spec, []).append(buffer)
        self.spares = spares

    def _allocate_keyed(self, specs: dict[str, Spec]) -> None:
        try:
            buffers = self.allocate(list(specs.values()), True)
        except (MemoryError, RuntimeError):  # as in _allocate_spares
            return
        self.buffers = {**self.buffers, **{key: (spec, b) for (key, spec), b in zip(specs.items(), buffers)}}

    def join(self) -> None:
        """Wait for an allocation still running."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def take(self, specs: dict[str, Spec], wait: Callable[[], None]) -> tuple[dict[str, torch.Tensor], set[str], bool]:
        """A buffer for each key of ``specs``: the previous save's of that key and spec (its key is in the returned
        set: the previous save may still be writing from it), else one allocated ahead, else a new one, allocated
        once everything not taken is let go; ``wait`` (for the previous save's write) is called first when some of
        its buffers are let go. Returns the buffers, the keys reused, and whether it waited."""
        self.join()
        self._remove_hooks_once_started()
        buffers, self.buffers = self.buffers, {}
        spares, self.spares = self.spares, {}
        chosen: dict[str, torch.Tensor] = {}
        reused: set[str] = set()
        missing = []
        for key, spec in specs.items():
            had = buffers.get(key)
            free = spares.get(spec)
            if had is not None and had[0] == spec:
                chosen[key] = had[1]
                reused.add(key)
            elif free:
                chosen[key] = free.pop()
            else:
                missing.append(key)
        waited = False
        if missing:  # the state changed shape (or nothing was allocated ahead): one copy at a time still
            if len(reused) < len(buffers):  # the previous save may still write from the buffers let go here
                wait()
                waited = True
            buffers.clear()  # those no save took are freed before new ones are allocated
            spares.clear()
            chosen.update(zip(missing, self.allocate([specs[k] for k in missing], False)))
        self.buffers = {key: (specs[key], chosen[key]) for key in specs}
        return chosen, reused, waited

    def _remove_hooks_once_started(self) -> None:
        if self._started:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        hooks, self._hooks = self._hooks, []
        for handle in hooks:
            handle.remove()

    def close(self) -> None:
        """Remove the hooks, wait for an allocation still running, let the memory go."""
        self._remove_hooks()
        self._started = False
        self.join()
        self.buffers, self.spares = {}, {}


def state_tensors(optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The optimizers' state tensors (Adam's moments and step counts, ...)."""
    return [v for opt in optimizers for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]
