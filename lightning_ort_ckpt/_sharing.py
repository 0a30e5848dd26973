"""Saves that write frozen tensors only when they changed: which ones a save can share with the previous one.

Fine-tuning keeps a large frozen part (``requires_grad=False`` parameters, buffers) and trains a small one. The
format layer can keep frozen tensors in a ``.data`` file that later checkpoints share by hard link
(``format.shared``); this module decides, per save, which frozen tensors are unchanged since the previous save of
the same plugin to the same directory, and remembers what each save put in its ``.data``.

Change is detected by torch first: the live module tensor (the very object, held weakly), its memory
(``data_ptr``, shape, strides, dtype, device) and its version counter, which in-place operations bump
(``load_state_dict``'s copies, ``optimizer.step``, ``torch.no_grad()`` edits). A tensor that differs in any of these
is written fresh. What torch calls unchanged is then confirmed by content: the writer hashes the tensors it links
on a helper thread while it writes the rest, and compares with the checksums recorded when the shared ``.data`` was
written. That catches what the counter misses: BatchNorm's kernels update its running statistics in place without
bumping it (a buffer found changed that way is never shared again), and a write through ``tensor.data`` bypasses it
(such a parameter gets a fresh ``.data``). A file never holds a frozen tensor other than the one saved. With
``trust_parameters`` (``share_frozen="trusted"``) frozen parameters are taken on torch's word and not hashed: a
little faster on a busy machine (docs/performance.md has the cost of hashing), but a write through ``.data`` then
goes unseen and the file keeps the old bytes.

Only tensors of the live module at least :data:`MIN_BYTES` large take part, and only when they add up to
:data:`MIN_TOTAL_BYTES`: below that a second file costs more than it saves. Sharing applies to local directories; a
remote (``scheme://``) path is written whole.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field, replace
from collections.abc import Collection
from typing import Any

import torch

from .errors import CheckpointSaveError
from .format import CheckpointContents, data_path, save_checkpoint
from .format._checksums import param_key
from .format._shared_data import Identity, NotShared, SavedData, SharedFrozen, identity
from .format._writer import ExternalData

MIN_BYTES = 64 << 10
"""A frozen tensor smaller than this stays inline (rewritten by every save)."""
MIN_TOTAL_BYTES = 1 << 20
"""Below this many bytes of frozen tensors, nothing is shared."""
_SOURCES = 8  # names of one shared .data remembered as link sources (any one of them that still exists will do)


def _state(t: torch.Tensor) -> tuple[Any, ...]:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version


@dataclass
class Snapshot:
    """The frozen tensors of one save call that may be shared, as they were at the call (training thread)."""

    directory: str
    live: dict[str, tuple[weakref.ref[torch.Tensor], tuple[Any, ...]]]
    params: set[str]  # the ones that are parameters (frozen ones): no forward pass changes them
    unchanged: set[str] = field(default_factory=set)  # also unchanged since the previous save call

    @property
    def keep(self) -> set[str]:
        """Frozen parameters an asynchronous save need not copy: unchanged since the previous call, which most likely
        shares them. Buffers are always copied: a forward pass may change them without a version bump."""
        return self.unchanged & self.params

    def still_live(self, name: str) -> bool:
        """Whether the live tensor ``name`` is still what it was at the save call."""
        ref, state = self.live[name]
        now = ref()
        return now is not None and _state(now) == state

    def still(self, name: str, then: tuple[weakref.ref[torch.Tensor], tuple[Any, ...]] | None) -> bool:
        """Whether ``name`` is the tensor it was in the snapshot ``then`` (same object, memory and version)."""
        now = self.live.get(name)
        return then is not None and now is not None and then[0]() is now[0]() is not None and then[1] == now[1]


@dataclass
class _Record:
    """What the previous sharing save of a directory put in its ``.data``."""

    sources: list[str]
    identity: Identity
    offsets: dict[str, int]
    digests: dict[str, int]
    seen: dict[str, tuple[weakref.ref[torch.Tensor], tuple[Any, ...]]] = field(default_factory=dict)


class FrozenSharing:
    """The sharing state of one plugin: the last save call's snapshot and the last save's record, per directory."""

    def __init__(self, trust_parameters: bool = False) -> None:
        self.trust_parameters = trust_parameters
        self._calls: dict[str, Snapshot] = {}
        self._records: dict[str, _Record] = {}
        # tensors found changed although their version was not (BatchNorm's running statistics: its kernels update
        # them in place without bumping the counter): never shared again, always written inline
        self._volatile: set[str] = set()

    def snapshot(self, ck: CheckpointContents, path: str, module: torch.nn.Module) -> Snapshot | None:
        """On the training thread, at the save call: the frozen tensors of ``ck`` that are the module's own and
        large enough, or None when there is too little to share (the plugin asks only where the store can link)."""
        live_tensors = module.state_dict(keep_vars=True)
        live: dict[str, tuple[weakref.ref[torch.Tensor], tuple[Any, ...]]] = {}
        for name, t in ck.frozen.items():
            mine = live_tensors.get(name)
            if (isinstance(t, torch.Tensor) and isinstance(mine, torch.Tensor) and mine.data_ptr() == t.data_ptr()
                    and mine.dtype == t.dtype and mine.shape == t.shape and t.layout == torch.strided
                    and t.numel() * t.element_size() >= MIN_BYTES and name not in self._volatile):
                live[name] = (weakref.ref(mine), _state(mine))
        if sum(ck.frozen[n].numel() * ck.frozen[n].element_size() for n in live) < MIN_TOTAL_BYTES:
            return None
        directory = os.path.dirname(os.path.abspath(path))
        snap = Snapshot(directory, live, {n for n in live if isinstance(live_tensors[n], torch.nn.Parameter)})
        before = self._calls.get(directory)
        snap.unchanged = {n for n in live if before is not None and snap.still(n, before.live.get(n))}
        self._calls[directory] = snap
        return snap

    def save(self, ck: CheckpointContents, path: str, snap: Snapshot, external_data: ExternalData,
             kept: Collection[str] = ()) -> None:
        """Write ``ck`` to ``path`` sharing what the previous save of the directory holds unchanged, and remember
        what this one holds. ``kept``: frozen parameters of ``ck`` that are the live ones, not staged copies (an
        asynchronous save); those this save writes after all are copied first, and must not have changed since the
        call."""
        record = self._records.pop(snap.directory, None)  # a failed save leaves none: the next one starts fresh
        spec = self._spec(ck, snap, record)
        copied: set[str] = set()
        while True:
            linked = spec.names.keys() if spec is not None and spec.link_from is not None else set()
            for name in set(kept) - linked - copied:  # written after all: from a copy, as the rest of the save
                ck.frozen[name] = _copy_unchanged(ck.frozen[name], snap, name, path)
                copied.add(name)
            try:
                saved = save_checkpoint(ck, path, external_data=external_data, shared=spec if not linked else
                                        replace(spec, changed_since_asked=lambda n: not snap.still_live(n)))
                break
            except NotShared as e:  # no link here, or tensors that changed unseen
                # a buffer is never shared again (a forward pass changes it unseen: BatchNorm's statistics); a
                # parameter changed through .data once: this save writes a fresh .data, and later ones share that
                self._volatile.update(n for n in e.names if n not in snap.params)
                moved = not e.names or any(n in snap.params for n in e.names)
                spec = self._spec(ck, snap, None if moved else record)
        if saved is not None:
            self._records[snap.directory] = self._remember(path, snap, saved, record)

    def _spec(self, ck: CheckpointContents, snap: Snapshot, record: _Record | None) -> SharedFrozen | None:
        if record is not None:
            same = {n: record.offsets[n] for n in snap.live if n in record.offsets and n not in self._volatile
                    and snap.still(n, record.seen.get(n))}
            shared_bytes = sum(ck.frozen[n].numel() * ck.frozen[n].element_size() for n in same)
            source = _source(record)
            if source is not None and shared_bytes * 2 >= record.identity[2] and shared_bytes >= MIN_TOTAL_BYTES:
                keys = [param_key(n) for n in same]
                trusted = frozenset(snap.params & same.keys()) if self.trust_parameters else frozenset()
                return SharedFrozen(same, source, record.identity,
                                    {k: record.digests[k] for k in keys if k in record.digests}, trusted)
        names = set(snap.live) - self._volatile  # a fresh .data
        if sum(ck.frozen[n].numel() * ck.frozen[n].element_size() for n in names) < MIN_TOTAL_BYTES:
            return None
        return SharedFrozen.fresh(names)

    def _remember(self, path: str, snap: Snapshot, saved: SavedData, record: _Record | None) -> _Record:
        sources = [data_path(os.path.abspath(path))]
        if saved.linked and record is not None:
            sources += [s for s in record.sources if s not in sources][:_SOURCES - 1]
        return _Record(sources, saved.identity, saved.offsets, saved.digests,
                       {n: snap.live[n] for n in saved.offsets if n in snap.live})


def _source(record: _Record) -> str | None:
    """A name that still reaches the recorded ``.data`` (the newest save's may be deleted or replaced since)."""
    for source in record.sources:
        try:
            st = os.stat(source, follow_symlinks=False)
        except OSError:
            continue
        if identity(st) == record.identity:
            return source
    return None


def _copy_unchanged(t: torch.Tensor, snap: Snapshot, name: str, path: str) -> torch.Tensor:
    """A copy of the live tensor ``t`` an asynchronous save kept uncopied, made on the writer thread; it must still
    be what it was at the save call."""
    copy = t.detach().to("cpu", copy=True)
    ref, state = snap.live[name]
    if ref() is None or _state(ref()) != state:  # type: ignore[arg-type]
        raise CheckpointSaveError(f"frozen tensor {name!r} was changed in place while its asynchronous save was "
                                  "being written; the file would mix two training steps, so it was not written", path)
    return copy
