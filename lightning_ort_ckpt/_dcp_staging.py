"""Staging for asynchronous sharded saves: each rank's shards copied into CPU memory of its own, so that the step
waits only for that copy and the write runs on the plugin's background queue.

- **Allocated ahead, reused**: :meth:`ShardStager.prepare` allocates (and touches) buffers for the local shards of
  the module's parameters and buffers and the optimizers' state on a thread of its own, once every optimizer has
  stepped (Adam makes its state in its first step); :meth:`ShardStager.prepare_like` (``dcp.async_save`` users,
  through ``OrtStorageWriter.allocate_staging``) allocates them for a given state dict, key by key. Each save copies
  into the previous save's buffer of the same key, else into one allocated ahead of the same shape and type, else
  into a new one. Buffers for CUDA shards are page-locked.
- **Bounded**: the caller stages a save only once the previous one is written (the plugin's ``wait``), so one copy
  of the rank's shards exists at a time; memory a save does not take (allocated ahead for shapes it does not have,
  or the previous save's of keys it lacks) is let go before it allocates what it lacks.
- **Collectives of their own**: the background write runs DCP's collectives (plans, results) while training runs
  its own (FSDP's all-gathers); on one process group the two threads' collectives could interleave differently on
  each rank. The writes use a gloo group made for them by every rank ahead of the first asynchronous save (in the
  step hook of :meth:`ShardStager.prepare`, which every rank reaches after the same optimizer step), else at it.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

Spec = tuple[tuple[int, ...], torch.dtype, bool]  # shape, dtype, page-locked
Sources = Callable[[], "tuple[list[torch.Tensor], list[torch.optim.Optimizer]] | None"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _spec(t: torch.Tensor) -> Spec:
    local = _local(t)
    return tuple(local.shape), local.dtype, local.device.type == "cuda"


def _new(spec: Spec, touch: bool) -> torch.Tensor:
    shape, dtype, pinned = spec
    buffer = torch.empty(shape, dtype=dtype, pin_memory=pinned)
    if touch and not pinned:  # page-locking faults every page in already
        buffer.zero_()
    return buffer


class ShardStager:
    """The staging memory of one plugin's asynchronous sharded saves, reused from save to save."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._spares: dict[Spec, list[torch.Tensor]] = {}
        self._group: Any = None
        self._hook: Any = None
        self._preparing: threading.Thread | None = None

    def ready(self) -> bool:
        """Whether the next save finds memory to copy into (allocated ahead, or the previous save's), without
        waiting for an allocation still running."""
        return (self._preparing is None or not self._preparing.is_alive()) and bool(self._spares or self._buffers)

    def prepare(self, sources: Sources) -> None:
        """Allocate the first save's memory ahead of it: ``sources`` gives the tensors a save will stage (the
        module's parameters and buffers, DTensors or not) and the optimizers (their state too), or None while saves
        are synchronous; asked after each optimizer step until every optimizer has stepped once. The process group
        of the background writes is made then too (every rank steps alike)."""
        stepped: set[int] = set()
        started = False

        def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            # (the hook stays until close: torch iterates over its hooks while calling this one)
            nonlocal started
            if started:
                return
            stepped.add(id(optimizer))
            found = sources()
            if found is None or not all(id(o) in stepped for o in found[1]):
                return
            started = True
            self.group()
            if self._buffers:  # a save came first: it allocated its memory
                return
            tensors, optimizers = found
            states = [v for opt in optimizers for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor)]
            self._start(self._allocate, [_spec(t) for t in [*tensors, *states]])

        self._hook = register_optimizer_step_post_hook(after_step)

    def prepare_like(self, flat: dict[str, torch.Tensor]) -> None:
        """Allocate (and touch) on a thread of its own a buffer for each key of ``flat`` (DCP keys to tensors and
        DTensors, as :meth:`stage` takes them), for the first save of that state to copy into."""
        self._join()  # an allocation still running: its keys have memory already
        self._start(self._allocate_keyed, {key: _spec(t) for key, t in flat.items() if key not in self._buffers})

    def _start(self, target: Callable[[Any], None], specs: Any) -> None:
        self._join()
        self._preparing = threading.Thread(target=target, args=(specs,), name="ort-ckpt-shard-staging", daemon=True)
        self._preparing.start()

    def _allocate(self, specs: list[Spec]) -> None:
        spares: dict[Spec, list[torch.Tensor]] = {}
        try:
            for spec in specs:
                spares.setdefault(spec, []).append(_new(spec, touch=True))
        except (MemoryError, RuntimeError):  # out of memory: the first save allocates, and reports it, itself
            return
        self._spares = spares

    def _allocate_keyed(self, specs: dict[str, Spec]) -> None:
        try:
            buffers = {key: _new(spec, touch=True) for key, spec in specs.items()}
        except (MemoryError, RuntimeError):  # as in _allocate
            return
        self._buffers = {**self._buffers, **buffers}

    def _join(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def group(self) -> Any:
        """The process group of the background writes (None without torch.distributed): made by every rank at its
        first asynchronous save (a collective on the default group, on the training thread)."""
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def stage(self, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``flat`` (DCP keys to tensors and DTensors) with each local shard copied into a buffer of its own (a
        DTensor stays a DTensor over the copy: same mesh, placements, global shape). Returns when every copy is
        complete: training may change its tensors then."""
        self._join()
        buffers, self._buffers = self._buffers, {}
        spares, self._spares = self._spares, {}
        specs = {key: _spec(t) for key, t in flat.items()}
        missing = []
        for key, spec in specs.items():  # the previous save's buffer of the key, else one allocated ahead, else new
            buffer = buffers.get(key)
            free = spares.get(spec)
            if buffer is not None and (tuple(buffer.shape), buffer.dtype, buffer.is_pinned()) == spec:
                self._buffers[key] = buffer
            elif free:
                self._buffers[key] = free.pop()
            else:
                missing.append(key)
        buffers.clear()  # those this save does not take are freed before it allocates what it lacks
        spares.clear()
        self._buffers.update((key, _new(specs[key], touch=False)) for key in missing)
        staged: dict[str, torch.Tensor] = {}
        cuda = False
        for key, t in flat.items():
            buffer = self._buffers[key]
            buffer.copy_(_local(t).detach(), non_blocking=specs[key][2])
            cuda |= specs[key][2]
            staged[key] = buffer if not isinstance(t, DTensor) else DTensor.from_local(
                buffer, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
        if cuda:
            torch.cuda.current_stream().synchronize()
        return staged

    def close(self) -> None:
        """Free the memory and the hook (after the last write; the plugin's ``teardown``)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._join()
        self._buffers, self._spares = {}, {}


def stage_tree(stager: ShardStager, tree: Any) -> Any:
    """A state dict as DCP hands it to a stager (nested dicts, lists, tuples) with every tensor (DTensor) replaced by
    its staged copy (:meth:`ShardStager.stage`, keyed by its path) and every other leaf deep-copied (an ``io.BytesIO``,
    a value training may change before it is written)."""
    staged = stager.stage(_tensors(tree))

    def build(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, torch.Tensor):
            return staged[repr(path)]
        if isinstance(node, dict):
            return type(node)((k, build(v, (*path, k))) for k, v in node.items())
        if _is_sequence(node):
            return type(node)(build(v, (*path, i)) for i, v in enumerate(node))
        return copy.deepcopy(node)

    return build(tree, ())


def prepare_tree(stager: ShardStager, tree: Any) -> None:
    """Allocate ahead the memory :func:`stage_tree` of ``tree`` (or of a state of the same keys and shapes) copies
    into (:meth:`ShardStager.prepare_like`)."""
    stager.prepare_like(_tensors(tree))


def _tensors(tree: Any) -> dict[str, torch.Tensor]:
    """The tensors (DTensors) of a state dict, keyed by their path in it."""
    flat: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, torch.Tensor):
            flat[repr(path)] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        elif _is_sequence(node):
            for i, v in enumerate(node):
                walk(v, (*path, i))

    walk(tree, ())
    return flat


def _is_sequence(node: Any) -> bool:
    return type(node) in (list, tuple)
