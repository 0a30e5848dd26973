"""Staging for asynchronous sharded saves: each rank's shards copied into CPU memory of its own, so that the step
waits only for that copy and the write runs on the plugin's background queue.

- **Allocated ahead, reused**: :meth:`ShardStager.prepare` allocates (and touches) buffers for the local shards of
  the module's parameters and the optimizers' state on a thread of its own, once every optimizer has stepped (Adam
  makes its state in its first step); each save copies into the previous save's buffer of the same key, else into
  one allocated ahead of the same shape and type, else into a new one. Buffers for CUDA shards are page-locked.
- **Bounded**: the caller stages a save only once the previous one is written (the plugin's ``wait``), so one copy
  of the rank's shards exists at a time.
- **Collectives of their own**: the background write runs DCP's collectives (plans, results) while training runs
  its own (FSDP's all-gathers); on one process group the two threads' collectives could interleave differently on
  each rank. The writes use a gloo group made for them, by every rank at its first asynchronous save.
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

    def prepare(self, sources: Sources) -> None:
        """Allocate the first save's memory ahead of it: ``sources`` gives the tensors a save will stage (the
        module's parameters, DTensors or not) and the optimizers (their state too), or None while saves are
        synchronous; asked after each optimizer step until every optimizer has stepped once."""
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
            tensors, optimizers = found
            states = [v for opt in optimizers for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor)]
            specs = [_spec(t) for t in [*tensors, *states]]
            self._preparing = threading.Thread(target=self._allocate, args=(specs,), name="ort-ckpt-shard-staging",
                                               daemon=True)
            self._preparing.start()

        self._hook = register_optimizer_step_post_hook(after_step)

    def _allocate(self, specs: list[Spec]) -> None:
        spares: dict[Spec, list[torch.Tensor]] = {}
        try:
            for spec in specs:
                spares.setdefault(spec, []).append(_new(spec, touch=True))
        except (MemoryError, RuntimeError):  # out of memory: the first save allocates, and reports it, itself
            return
        self._spares = spares

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
        staged: dict[str, torch.Tensor] = {}
        cuda = False
        for key, t in flat.items():
            local = _local(t).detach()
            spec = _spec(t)
            buffer = buffers.get(key)
            if buffer is None or (tuple(buffer.shape), buffer.dtype, buffer.is_pinned()) != spec:
                free = self._spares.get(spec)
                buffer = free.pop() if free else _new(spec, touch=False)
            buffer.copy_(local, non_blocking=spec[2])
            cuda |= spec[2]
            self._buffers[key] = buffer
            staged[key] = buffer if not isinstance(t, DTensor) else DTensor.from_local(
                buffer, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
        self._spares = {}  # those no save took are freed
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
    flat: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: tuple[Any, ...], build: bool) -> Any:
        if isinstance(node, torch.Tensor):
            if not build:
                flat[repr(path)] = node
                return None
            return staged[repr(path)]
        if isinstance(node, dict):
            items = [(k, walk(v, (*path, k), build)) for k, v in node.items()]
            return type(node)(items) if build else None
        if isinstance(node, (list, tuple)) and type(node) in (list, tuple):
            items = [walk(v, (*path, i), build) for i, v in enumerate(node)]
            return type(node)(items) if build else None
        return copy.deepcopy(node) if build else None

    walk(tree, (), build=False)
    staged = stager.stage(flat)
    return walk(tree, (), build=True)
