"""Staging for asynchronous saves: copies of a checkpoint's tensors that training cannot change, made out of its way.

An asynchronous save must own the bytes it writes, because training changes its tensors as soon as the save call
returns. :class:`Stager` makes those copies with these rules:

- **Bounded**: the plugin stages a save only once the previous one is written (``OrtCheckpointIO`` waits for it),
  so one checkpoint's worth of staging memory exists at a time and saves never pile up: saves asked for faster than
  the disk writes them take the disk's pace, as synchronous saves would.
- **Reused memory, allocated ahead** (``_staging_memory``, shared with the sharded layout): each save copies into the
  previous save's buffers. A copy into memory already touched runs at memcpy speed; into fresh memory it pays a page
  fault per page, which on VMs is slower than the disk. The first save's buffers are allocated and touched ahead of
  it (:meth:`Stager.prepare`); a first save that writes directly (below) lets them go. Memory for CUDA tensors is
  page-locked (pinned), one block for the whole state, so the GPU copies into it asynchronously; it is released by
  :meth:`Stager.close` (the plugin's ``teardown``).
- **Out of the training thread's way**: tensors that only an optimizer step changes (the parameters the optimizers
  hold, and the optimizers' state) are deferred: on CPU they are copied on the writer thread while training runs its
  next forward and backward pass; on CUDA they are copied from the GPU at once, but on a side stream that first waits
  for the training stream, into pinned memory, without blocking the CPU; the writer thread waits for those copies
  before writing. An optimizer step waits only for the copies of the tensors *it* holds (a step pre-hook on each
  optimizer a save defers to, registered by the save and removed at :meth:`Stager.close`; for a step given a
  closure, as Lightning steps, after the closure's forward and backward): on CPU by blocking until
  the writer made them, on CUDA by making the training stream wait for the copies' events (no CPU block). The
  device-specific part is a :class:`CopyOrder` per tensor (``record``, ``wait_on_device``, ``synchronize``).
  Buffers, which a forward pass may update, and everything else are copied before the save call returns (on CUDA:
  enqueued on the side stream, the training stream waiting for them before its next kernel). If a deferred tensor
  is changed in place before its copy is done anyway (in-place edits outside ``optimizer.step``, seen by torch's
  version counter), the save fails loudly instead of writing a mix of two steps.

**Direct writes** (``stage(direct=True)``: a save to a memory file system): the deferred tensors in CPU memory are not
copied at all. The save writes them from where they are and its job runs once the write has read them (and hashed
them), before the commit; the optimizer steps wait for that instead of a copy. One pass over the state's memory
instead of two, and no staging memory for it: on a memory file system the write costs about what the copy did.

Frozen parameters unchanged since the previous save call, which a save will most likely not write at all (their
``.data`` is linked: see ``sharing``), are not copied: the plugin names them in ``keep``.

A save that follows another with no optimizer step in between (``last.ckpt`` right after the top-k file of the
same step) reuses the first save's copies of every tensor whose version is unchanged, instead of copying again.
"""

from __future__ import annotations

import functools
import mmap
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._staging_memory import Sources, Spec, StagingMemory, state_tensors
from .._translation._torch_compat import version_counter
from ..errors import CheckpointSaveError, CheckpointWarning
from ..format import CheckpointContents, OptimizerGroup, StoredAs

_ALIGN = 64  # bytes: where each buffer starts inside a pinned block
_PAGE = mmap.PAGESIZE


class CopyOrder:
    """When one tensor's staging copy is complete, in the terms of the device that makes it. The overlap logic
    (who copies, who waits for what) uses only these three verbs, so it runs the same with threads on CPU and with
    streams on CUDA."""

    def record(self) -> None:
        """The copy is issued: every wait below is for the work up to this call."""
        raise NotImplementedError

    def wait_on_device(self) -> None:
        """Order what the training thread does next to the source after the copy (an optimizer update)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block the calling thread (the writer) until the copy is in its buffer."""
        raise NotImplementedError


class HostOrder(CopyOrder):
    """A copy the writer thread makes: ``record`` once it is made; the training thread's wait blocks it. A lock held
    until then (a ``threading.Event`` per tensor costs a condition variable each: a few microseconds per tensor of
    every save)."""

    def __init__(self) -> None:
        self._held = threading.Lock()
        self._held.acquire()
        self._recorded = False

    def record(self) -> None:
        if not self._recorded:  # only the writer thread records
            self._recorded = True
            self._held.release()

    def wait_on_device(self) -> None:
        if not self._recorded:
            with self._held:
                pass

    def synchronize(self) -> None:
        self.wait_on_device()


class CudaOrder(CopyOrder):
    """A copy enqueued on a side stream: ``record`` records an event after it; the training stream waits for the
    event on the GPU (the CPU goes on), the writer thread blocks on it."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._event = torch.cuda.Event()

    def record(self) -> None:
        self._event.record(self._stream)

    def wait_on_device(self) -> None:
        torch.cuda.current_stream(self._stream.device).wait_event(self._event)

    def synchronize(self) -> None:
        self._event.synchronize()


@dataclass(eq=False, slots=True)
class _Item:
    """One staged copy: of ``source`` into ``dest``, ordered by ``order``. ``host``: the writer thread makes it (else
    it is enqueued already). ``deferred``: an optimizer step may change the source before the copy is done (the
    writer checks ``version`` against the source's, or against ``released``, its version when a step let go)."""

    name: str
    source: torch.Tensor
    dest: torch.Tensor
    order: CopyOrder
    host: bool
    deferred: bool
    version: int
    released: int | None = None


@dataclass(eq=False)
class Job:
    """The copies of one save to make or wait for on the writer thread, before its write (a direct write's: none to
    make, run once the write has read its tensors); ``done`` is set when they are made (or failed)."""

    path: str
    pending: dict[int, list[_Item]]  # the stager's deferred copies not made yet, by source memory
    lock: threading.Lock  # the stager's, over ``pending`` and the versions a step released
    items: list[_Item] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self) -> None:
        try:
            torn = []
            # copies made here first: a step blocked on one of them must not wait behind a GPU copy
            for item in sorted(self.items, key=lambda i: not i.host):
                if item.host:
                    if item.dest is not item.source:  # (a direct write's tensor: read by the write already)
                        item.dest.copy_(item.source.detach())
                    item.order.record()
                else:
                    item.order.synchronize()
                if item.deferred:
                    with self.lock:
                        seen = item.released if item.released is not None else version_counter(item.source)
                    if seen != item.version:
                        torn.append(item.name)
            if torn:
                raise CheckpointSaveError(
                    f"{torn[0]!r} ({len(torn)} tensor(s) in all) was changed in place while its asynchronous "
                    "save was copying it (outside optimizer.step, which waits for the copy); the file would mix two "
                    "training steps, so it was not written. Save synchronously, or make the change after the save "
                    "is durable (checkpoint_io.wait())", self.path)
        finally:
            self.skipped()

    def skipped(self) -> None:
        """Release the optimizer steps waiting for these copies (the writer calls this when an earlier error stops
        it from running them at all); copies on the GPU are waited for, so their memory may be freed."""
        with self.lock:
            for item in self.items:
                waiting = self.pending.get(item.source.data_ptr())
                if waiting is not None and item in waiting:
                    waiting.remove(item)
                    if not waiting:
                        del self.pending[item.source.data_ptr()]
        for item in self.items:
            if item.host:
                item.order.record()
            else:
                item.order.synchronize()
        self.items = []  # the sources are no longer needed
        self.done.set()


def _spec(t: torch.Tensor) -> Spec:
    """The buffer a copy of ``t`` needs: pinned for CUDA tensors (where CUDA is available), so the copy from the GPU
    can run asynchronously."""
    return tuple(t.shape), t.dtype, t.is_cuda and torch.cuda.is_available()


def _pin(block: torch.Tensor) -> torch.Tensor | None:
    """Page-lock the whole pages inside ``block`` where they are (``cudaHostRegister``, as
    ``torch.distributed.checkpoint`` stages) and return them as a tensor, or None if CUDA refuses (the locked-memory
    limit). Unlike ``pin_memory=True``, whose caching allocator rounds each block up to a power of two and keeps it
    after use, this locks the state's bytes (plus at most a page) and gives them back at :meth:`Stager.close`; only
    whole pages of our own, so no other allocation shares a locked page."""
    start = -block.data_ptr() % _PAGE
    pages = block[start:start + -(-(block.numel() - 2 * _PAGE) // _PAGE) * _PAGE]  # inside: 2 pages to spare
    if int(torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), pages.numel(), 0)) != 0:
        return None
    return pages


def _unpin(pages: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(pages.data_ptr())


class Stager:
    """The staging memory of one plugin (``_staging_memory``, with page-locked blocks for CUDA tensors), reused from
    save to save, and the step pre-hooks on the optimizers its saves defer copies to."""

    def __init__(self) -> None:
        self._pinned: list[torch.Tensor] = []  # page-locked blocks, unpinned at close
        # the memory's allocator holds the list of blocks, not this stager: no reference cycle through it, so a
        # stager let go is freed at once, never left to the garbage collector
        self._memory = StagingMemory(functools.partial(_allocate, self._pinned), _spec, "ort-ckpt-staging")
        # what each buffer holds a copy of, for tensors of the live module or optimizers: the source tensor (held, so
        # its memory cannot be freed and handed to another tensor meanwhile), its version and the step count then
        self._sources: dict[str, tuple[torch.Tensor, int, int]] = {}
        self._streams: dict[torch.device, Any] = {}  # the side stream of each GPU
        self._lock = threading.Lock()
        self._pending: dict[int, list[_Item]] = {}  # deferred copies not made yet, by source memory
        self._steps = 0  # steps the hooked optimizers took
        self._hooked: list[tuple[weakref.ref[torch.optim.Optimizer], Any]] = []  # each optimizer and its pre-hook

    def close(self) -> None:
        """Free the staging memory and remove the optimizers' step hooks (once every save is written)."""
        hooked, self._hooked = self._hooked, []
        for _, handle in hooked:
            handle.remove()
        self._memory.close()
        self._sources, self._streams = {}, {}
        pinned = list(self._pinned)
        self._pinned.clear()
        for block in pinned:
            _unpin(block)

    def ready(self) -> bool:
        """Whether the next save finds memory to copy into, without waiting for an allocation still running."""
        return self._memory.ready()

    def prepare(self, sources: Sources) -> None:
        """Allocate (and touch, or pin) the first save's staging memory ahead of it, on a background thread, once
        every optimizer ``sources()`` names has stepped (from :meth:`arm` on: ``StagingMemory``): touching fresh memory costs a
        page fault per page and pinning it more; off the training thread, a save every N steps finds it done."""
        self._memory.prepare(sources)

    def arm(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The fit's ``optimizers`` exist: wait for their first steps (``StagingMemory.arm``)."""
        self._memory.arm(optimizers)

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def stage(self, ck: CheckpointContents, path: str, deferrable: Iterable[torch.Tensor], live: Iterable[torch.Tensor],
              wait_for_buffers: Callable[[], None], keep: Collection[str] = (),
              optimizers: Sequence[torch.optim.Optimizer] = (), direct: bool = False) -> tuple[CheckpointContents,
                                                                                              Job]:
        """``ck`` with every tensor replaced by a buffer of its own (``direct``: but the deferred ones in CPU memory,
        written from where they are: the returned job then runs once the write has read them, not before it).

        Tensors that share memory with ``deferrable`` (parameters the optimizers hold, and their state) and that one
        of ``optimizers`` holds are copied by the returned job (run it on the writer thread, before the write; CUDA
        ones are enqueued now, and the job waits for them): those optimizers' steps wait for them (a step pre-hook
        on each, until :meth:`close`). All others are copied now. A tensor of ``live`` (the module's parameters and
        buffers, and ``deferrable``) unchanged since the previous save, with no step of those optimizers since,
        reuses that save's copy. ``wait_for_buffers`` is called before the first copy into memory that an earlier
        save may still be writing from: a save that reuses every copy waits for nothing. Frozen tensors named in
        ``keep`` stay the live ones, uncopied (``sharing``: unchanged frozen tensors that the save will most likely
        not write at all)."""
        self._hook(optimizers)
        entries = _entries(ck, keep)
        held = {t.data_ptr() for t in optimizer_tensors(optimizers)}
        defer = {t.data_ptr() for t in deferrable} & held
        in_place = {where for where, t in entries.items()
                    if direct and t.data_ptr() in defer and t.device.type == "cpu"}
        specs = {where: _spec(t) for where, t in entries.items() if where not in in_place}
        chosen, reused, waited = self._memory.take(specs, wait_for_buffers)
        job = Job(path, self._pending, self._lock)
        live_memory = defer | {t.data_ptr() for t in live}
        sources, self._sources = self._sources, {}
        streams_waited: set[torch.device] = set()
        for where, t in entries.items():
            if where in in_place:  # written from the live tensor; the optimizer's step waits for the write
                job.items.append(_Item(where, t, t, HostOrder(), True, True, version_counter(t)))
                chosen[where] = t
                continue
            previous = sources.get(where)
            if not (where in reused and previous is not None and previous[0].data_ptr() == t.data_ptr()
                    and previous[0].device == t.device and previous[1:] == (version_counter(t), self._steps)):
                if where in reused and not waited:
                    wait_for_buffers()
                    waited = True
                item = self._copy(where, t, chosen[where], t.data_ptr() in defer, specs[where][2], streams_waited)
                if item is not None:
                    job.items.append(item)
            # else: unchanged since the last save copied it, with no optimizer step since: reuse that copy
            if t.data_ptr() in live_memory:
                self._sources[where] = (t, version_counter(t), self._steps)
        with self._lock:
            for item in job.items:
                if item.deferred:
                    self._pending.setdefault(item.source.data_ptr(), []).append(item)
        if not job.items:
            job.done.set()
        return _staged(ck, chosen, keep), job

    def _copy(self, where: str, t: torch.Tensor, buffer: torch.Tensor, deferred: bool, from_gpu: bool,
              streams_waited: set[torch.device]) -> _Item | None:
        """Copy ``t`` into ``buffer`` now, or say how its copy completes: enqueued on its GPU's side stream (after
        the work queued so far), or left to the writer thread (a deferred CPU tensor)."""
        if from_gpu:
            stream = self._stream(t.device)
            if t.device not in streams_waited:
                stream.wait_stream(torch.cuda.current_stream(t.device))
                streams_waited.add(t.device)
            order: CopyOrder = CudaOrder(stream)
            with torch.cuda.stream(stream):
                buffer.copy_(t.detach(), non_blocking=True)
            order.record()
            if not deferred:  # a forward pass may change it: the training stream waits for its copy
                order.wait_on_device()
            return _Item(where, t, buffer, order, False, deferred, version_counter(t))
        if deferred:
            return _Item(where, t, buffer, HostOrder(), True, True, version_counter(t))
        buffer.copy_(t.detach())
        return None

    def _hook(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """A step pre-hook on each of ``optimizers`` not hooked yet (removed at :meth:`close`)."""
        for optimizer in optimizers:
            if not any(ref() is optimizer for ref, _ in self._hooked):
                self._hooked.append((weakref.ref(optimizer), optimizer.register_step_pre_hook(self._before_step)))

    def _before_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The step pre-hook: no optimizer changes a tensor while a copy of it is still being made.

        A step given a closure (Lightning's automatic optimization: the closure runs forward and backward inside
        ``step``) gets the closure wrapped, so the wait comes after the forward and backward pass, right before the
        update; a step without one waits here (its forward and backward pass ran before the call).
        """
        self._steps += 1
        if not self._pending:
            return None
        # torch passes the step's own arguments with the optimizer first: (optimizer, closure?) or closure=...
        closure = kwargs["closure"] if "closure" in kwargs else args[1] if len(args) > 1 else None
        if not callable(closure):
            self._wait_for_copies(optimizer)
            return None

        def closure_then_wait(*a: Any, **k: Any) -> Any:
            result = closure(*a, **k)
            self._wait_for_copies(optimizer)
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (args[0], closure_then_wait, *args[2:]), kwargs

    def _wait_for_copies(self, optimizer: torch.optim.Optimizer) -> None:
        """Order ``optimizer``'s update after the pending copies of the tensors it holds (its parameters and state),
        and of no other: a second optimizer's pending copy does not hold this one's step."""
        if not self._pending:
            return
        held = optimizer_tensors([optimizer])
        with self._lock:
            items = [item for t in held for item in self._pending.get(t.data_ptr(), ())]
        for item in items:
            item.order.wait_on_device()
        with self._lock:
            for item in items:  # the versions before this update: the writer's in-place check must not count it
                if item.released is None:
                    item.released = version_counter(item.source)


def _allocate(blocks: list[torch.Tensor], specs: list[Spec], touch: bool) -> list[torch.Tensor]:
    """A :class:`Stager`'s buffers for ``specs``: the pinned ones carved from one page-locked block (pinning faults
    every page in; the block is added to ``blocks``, the stager's, unpinned at close), the others separate, touched if
    ``touch`` (else their first copy faults them in)."""
    out: list[torch.Tensor] = []
    offsets, size = [], 0
    for shape, dtype, pinned in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        offsets.append(size if pinned and nbytes else None)
        size += -(-nbytes // _ALIGN) * _ALIGN if pinned else 0
    block = _pinned_block(size, blocks) if size else None
    for (shape, dtype, _), start in zip(specs, offsets):
        if start is None or block is None:
            out.append(torch.empty(shape, dtype=dtype))
            if touch:
                out[-1].zero_()
        else:
            out.append(block[start:start + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape))
    return out


def _pinned_block(size: int, blocks: list[torch.Tensor]) -> torch.Tensor | None:
    pages = _pin(torch.empty(size + 2 * _PAGE, dtype=torch.uint8))
    if pages is None:
        warnings.warn(f"could not page-lock {size / 2**20:.0f} MiB of staging memory for asynchronous saves (the "
                      "locked-memory limit, ulimit -l?): the copies from the GPU block training while they run",
                      CheckpointWarning, stacklevel=3)
        return None
    blocks.append(pages)
    return pages


def _entries(ck: CheckpointContents, keep: Collection[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``ck`` to stage, by where they are (``group/param/state`` for optimizer state), but the frozen
    ones of ``keep``; a narrow tensor (``StoredAs``) as it is."""
    entries: dict[str, torch.Tensor] = {}

    def collect(where: str, t: Any) -> None:
        if isinstance(t, StoredAs):  # staged as it is (the narrow type), converted as it is written
            collect(where, t.tensor)
        elif isinstance(t, torch.Tensor):
            entries[where] = t

    for n, t in ck.trainable.items():
        collect(n, t)
    for n, t in ck.frozen.items():
        if n not in keep:
            collect(n, t)
    for g, grp in ck.optimizer_groups.items():
        for p, ms in grp.states.items():
            for m, t in ms.items():
                collect(f"{g}/{p}/{m}", t)
    return entries


def _staged(ck: CheckpointContents, chosen: dict[str, torch.Tensor], keep: Collection[str]) -> CheckpointContents:
    """``ck`` with each staged tensor replaced by its buffer in ``chosen`` (the frozen ones of ``keep`` stay)."""

    def put(where: str, t: Any) -> Any:
        if isinstance(t, StoredAs):
            return StoredAs(put(where, t.tensor), t.dtype)
        return chosen[where] if isinstance(t, torch.Tensor) else t

    return CheckpointContents(
        trainable={n: put(n, t) for n, t in ck.trainable.items()},
        frozen={n: t if n in keep else put(n, t) for n, t in ck.frozen.items()},
        optimizer_groups={g: OptimizerGroup(grp.step, grp.initial_learning_rate,
                                            {p: {m: put(f"{g}/{p}/{m}", t) for m, t in ms.items()}
                                             for p, ms in grp.states.items()})
                          for g, grp in ck.optimizer_groups.items()},
        properties=dict(ck.properties), nominal=ck.nominal)


def optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The tensors only ``optimizer.step`` changes: the parameters the optimizers hold, and their state."""
    optimizers = list(optimizers)
    return [p for opt in optimizers for group in opt.param_groups for p in group["params"]] + state_tensors(optimizers)
