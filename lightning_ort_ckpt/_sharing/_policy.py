"""The entry of frozen sharing on the save path: one decision per save call (:meth:`FrozenSharing.decide`, on the
training thread), carried out by :meth:`Decision.write` wherever the save runs; the plan chosen by the directory's
:class:`~._copies.Copies` and handed to the writer; what is saved instead where the writer refuses it."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

import torch

from . import _limits
from ._copies import Copies, Worker
from ._snapshot import Seen, Snapshot, copy_unchanged, nbytes, state, tensor
from ..format import CheckpointContents, save_checkpoint
from ..format._shared_data import NotShared, SharedTooLarge
from ..format._store import Store, store_for
from ..format._writer import ExternalData


class FrozenSharing:
    """The sharing state of one plugin: the last save call's snapshot, the tensors never shared, and, per directory,
    the independent copies of the frozen tensors that later saves may link (:class:`~._copies.Copies`, which makes
    every choice about them); one worker thread for their background copies and read-backs."""

    def __init__(self, trust_parameters: bool = False) -> None:
        self.trust_parameters = trust_parameters
        self._calls: dict[str, Snapshot] = {}
        self._dirs: dict[str, Copies] = {}
        # tensors found changed although their version was not (BatchNorm's running statistics: its kernels update
        # them in place without bumping the counter): never shared again, always written inline
        self._volatile: set[str] = set()
        self._worker = Worker()  # background copies and read-backs; stopped by close()

    def decide(self, ck: CheckpointContents, path: str, module: torch.nn.Module | None, external_data: ExternalData,
               store: Store) -> Decision:
        """The one decision of a save call, on the training thread: what it may share (only with ``module``, the live
        module whose tensors ``ck`` holds, with ``external_data="auto"`` and a store that links), carried out later by
        :meth:`Decision.write` wherever the save runs."""
        if module is None or external_data != "auto" or not store.links:
            return Decision(self, None, external_data)
        return Decision(self, self.snapshot(ck, path, module), external_data)

    def snapshot(self, ck: CheckpointContents, path: str, module: torch.nn.Module) -> Snapshot | None:
        """On the training thread, at the save call: the frozen tensors of ``ck`` that are the module's own and
        large enough, or None when there is too little to share (the plugin asks only where the store can link)."""
        live_tensors = module.state_dict(keep_vars=True)
        live: dict[str, Seen] = {}
        for name, t in ck.frozen.items():
            mine = live_tensors.get(name)
            if (isinstance(t, torch.Tensor) and isinstance(mine, torch.Tensor) and mine.data_ptr() == t.data_ptr()
                    and mine.dtype == t.dtype and mine.shape == t.shape and t.layout == torch.strided
                    and t.numel() * t.element_size() >= _limits.MIN_BYTES and name not in self._volatile):
                live[name] = (weakref.ref(mine), state(mine))
        if nbytes(ck, live) < _limits.MIN_TOTAL_BYTES:
            return None
        directory = os.path.dirname(os.path.abspath(path))
        snap = Snapshot(directory, live, {n for n in live if isinstance(live_tensors[n], torch.nn.Parameter)},
                        tensors={n: live_tensors[n] for n in live})
        before = self._calls.get(directory)
        snap.unchanged = {n for n in live if before is not None and snap.still(n, before.live.get(n))}
        self._calls[directory] = snap
        return snap

    def save(self, ck: CheckpointContents, path: str, snap: Snapshot, external_data: ExternalData,
             kept: Collection[str] = (), store: Store | None = None,
             when_read: Callable[[], None] | None = None) -> None:
        """Write ``ck`` to ``path`` through ``store`` (one that ``links``; by default the path's own) sharing what a
        copy of the directory holds unchanged, and remember what this save holds. ``kept``: frozen parameters of
        ``ck`` that are the live ones, not staged copies (an asynchronous save); those this save writes after all
        are copied first, and must not have changed since the call."""
        copies = self._dirs.get(snap.directory)
        if copies is None:
            copies = self._dirs[snap.directory] = Copies(snap.directory, self._worker)
        copies.begin()
        store = store if store is not None else store_for(path)
        try:
            self._save(ck, path, store, snap, external_data, kept, copies, when_read)
        except BaseException:
            copies.forget()
            raise
        finally:
            snap.tensors.clear()

    def _save(self, ck: CheckpointContents, path: str, store: Store, snap: Snapshot, external_data: ExternalData,
              kept: Collection[str], copies: Copies, when_read: Callable[[], None] | None) -> None:
        chosen, spec = copies.choose(ck, snap, self._volatile, self.trust_parameters, path)
        copied: set[str] = set()
        while True:
            linked = spec.names.keys() if spec is not None and spec.link_from is not None else set()
            for name in set(kept) - linked - copied:  # written after all: from a copy, as the rest of the save
                ck.frozen[name] = copy_unchanged(tensor(ck, name), snap, name, path)
                copied.add(name)
            try:
                saved = save_checkpoint(ck, path, store=store, external_data=external_data, when_read=when_read,
                                        shared=spec if not linked or spec is None else
                                        replace(spec, changed_since_asked=lambda n: not snap.still_live(n)))
                break
            except SharedTooLarge:  # the rest inline would pass 2 GiB: this save is written whole, as "auto" does
                saved = save_checkpoint(ck, path, store=store, external_data=external_data, when_read=when_read)
                break
            except NotShared as e:  # no link here, or tensors that changed unseen
                # a buffer is never shared again (a forward pass changes it unseen: BatchNorm's statistics); a
                # parameter changed through .data once: this save writes a fresh .data, and later ones share that
                self._volatile.update(n for n in e.names if n not in snap.params)
                copies.refused(link=not e.names, all_copies=not e.names or any(n in snap.params for n in e.names))
                chosen, spec = copies.choose(ck, snap, self._volatile, self.trust_parameters, path)
        if saved is not None:
            copies.record(path, snap, saved, chosen, store)

    def close(self) -> None:
        """At the plugin's teardown: wait for the background copies and read-backs, stop their thread, and delete
        the copies written for later saves that no save linked (the copies the checkpoints link stay)."""
        self._worker.close()
        for copies in self._dirs.values():
            copies.close()

    def before_remove(self, path: str) -> None:
        """Before checkpoint ``path`` is deleted (on the thread that deletes it, just before): its directory's
        copies keep what retention must not take (:meth:`Copies.before_remove <._copies.Copies.before_remove>`)."""
        path = os.path.abspath(path)
        copies = self._dirs.get(os.path.dirname(path))
        if copies is not None:
            copies.before_remove(path)


@dataclass(frozen=True)
class Decision:
    """A save as :meth:`FrozenSharing.decide` decided it at the call: the frozen parameters an asynchronous save need
    not copy (:attr:`keep`), and the write that carries the decision out (:meth:`write`)."""

    sharing: FrozenSharing
    snap: Snapshot | None  # None: nothing shared, the file is written whole
    external_data: ExternalData

    @property
    def keep(self) -> frozenset[str]:
        return frozenset(self.snap.keep) if self.snap is not None else frozenset()

    def write(self, ck: CheckpointContents, path: str, kept: Collection[str], store: Store,
              when_read: Callable[[], None] | None = None) -> None:
        """Write ``ck`` to ``path``; ``kept``: the frozen parameters of :attr:`keep` that it holds live, not staged;
        ``when_read``: ``format.save_checkpoint``'s, for the write that commits."""
        if self.snap is None:
            save_checkpoint(ck, path, store=store, external_data=self.external_data, when_read=when_read)
        else:
            self.sharing.save(ck, path, self.snap, self.external_data, kept, store, when_read)
