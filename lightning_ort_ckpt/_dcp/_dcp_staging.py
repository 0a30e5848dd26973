"""Staging for asynchronous sharded saves: each rank's shards copied into CPU memory of its own, so that the step
waits only for that copy and the write runs on the plugin's background queue.

- **Allocated ahead, reused** (``_staging_memory``, shared with the single-device layout): :meth:`ShardStager.prepare`
  allocates (and touches) buffers for the local shards of the module's parameters and buffers and the optimizers'
  state on a thread of its own, once every optimizer has stepped (Adam makes its state in its first step);
  :meth:`ShardStager.prepare_like` (``dcp.async_save`` users, through ``OrtStorageWriter.allocate_staging``)
  allocates them for a given state dict, key by key. Each save copies into the previous save's buffer of the same
  key, else into one allocated ahead of the same shape and type, else into a new one. Buffers for CUDA shards are
  page-locked.
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
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._saving._staging_memory import Sources, Spec, StagingMemory


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


def _allocate(specs: list[Spec], touch: bool) -> list[torch.Tensor]:
    return [_new(spec, touch) for spec in specs]


class _WriteGroup:
    """The process group of the background writes (None without torch.distributed): made by every rank at its first
    asynchronous save (a collective on the default group, on the training thread), destroyed at :meth:`close`. Apart
    from :class:`ShardStager`, so that the staging memory, which calls it, holds no reference back to the stager."""

    def __init__(self) -> None:
        self._group: Any = None

    def __call__(self) -> Any:
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)


class ShardStager:
    """The staging memory of one plugin's asynchronous sharded saves (``_staging_memory``), reused from save to
    save, and the process group of their writes."""

    def __init__(self) -> None:
        self._memory = StagingMemory(_allocate, _spec, "ort-ckpt-shard-staging")
        self._writes = _WriteGroup()

    def ready(self) -> bool:
        """Whether the next save finds memory to copy into (allocated ahead, or the previous save's), without
        waiting for an allocation still running."""
        return self._memory.ready()

    def prepare(self, sources: Sources) -> None:
        """Allocate the first save's memory ahead of it: ``sources`` gives the tensors a save will stage (the
        module's parameters and buffers, DTensors or not) and the optimizers (their state too), or None while saves
        are synchronous; asked, from :meth:`arm` on, after each optimizer step until every optimizer has stepped once. The process group
        of the background writes is made then too (every rank steps alike)."""
        self._memory.prepare(sources, first=self._writes)

    def arm(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The fit's ``optimizers`` exist: wait for their first steps (``StagingMemory.arm``)."""
        self._memory.arm(optimizers)

    def prepare_like(self, flat: dict[str, torch.Tensor]) -> None:
        """Allocate (and touch) on a thread of its own a buffer for each key of ``flat`` (DCP keys to tensors and
        DTensors, as :meth:`stage` takes them), for the first save of that state to copy into."""
        self._memory.prepare_keys({key: _spec(t) for key, t in flat.items()})

    def group(self) -> Any:
        """The process group of the background writes (None without torch.distributed): made by every rank at its
        first asynchronous save (a collective on the default group, on the training thread)."""
        return self._writes()

    def stage(self, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``flat`` (DCP keys to tensors and DTensors) with each local shard copied into a buffer of its own (a
        DTensor stays a DTensor over the copy: same mesh, placements, global shape). Returns when every copy is
        complete: training may change its tensors then (the caller stages once the previous save is written)."""
        specs = {key: _spec(t) for key, t in flat.items()}
        chosen, _, _ = self._memory.take(specs, lambda: None)
        staged: dict[str, torch.Tensor] = {}
        cuda = False
        for key, t in flat.items():
            buffer = chosen[key]
            buffer.copy_(_local(t).detach(), non_blocking=specs[key][2])
            cuda |= specs[key][2]
            staged[key] = buffer if not isinstance(t, DTensor) else DTensor.from_local(
                buffer, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
        if cuda:
            torch.cuda.current_stream().synchronize()
        return staged

    def close(self) -> None:
        """Free the memory, remove the step hooks and destroy the process group of the background writes (after the
        last write; the plugin's ``teardown``): its sockets and threads are the fit's, not the process's."""
        self._memory.close()
        self._writes.close()


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
