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

No single point of failure: the saves of a directory keep two independent ``.data`` files of the frozen tensors and
alternate between them, and a file is read back against its checksums before it is linked when it may have changed
(:class:`FrozenSharing`); one damaged file costs no checkpoint: readers take its tensors from the other copy
(``format._shared_data.OtherCopies``), and the save that finds it repairs the checkpoints linking it (a fresh copy
from good bytes, relinked: ``_frozen_copies``, which tracks the copies this module chooses between). Retention does
not undo that: where it deletes the last checkpoint of one copy while kept checkpoints link the other, the copy stays
under a hidden reserve name until two copies are named by checkpoints again (:meth:`FrozenSharing.before_remove`).

Off the save path: the second copy, the renewal of a copy, and the periodic read-backs are done by one worker thread
of the :class:`FrozenSharing` (started on first need, stopped by :meth:`FrozenSharing.close` at the plugin's
teardown, which waits for it; nothing at import, nothing global). A copy written there is a new file (the bytes
copied in the kernel, never cloned), made durable, and read back against the checksums before any save may link it;
a read-back is started ahead and taken by the save that links the copy, which waits for it only where it is due and
not done. **The window with one copy**: after a save that writes the frozen part fresh with no second copy to link
(the first save to a directory, and the first after the frozen tensors changed), the next :data:`ONE_COPY_SAVES`
saves link that one copy while the second is written; the save after them waits for it. Those checkpoints (at most
``1 + ONE_COPY_SAVES``) share one file: damage to it in that window takes them all, as with one copy. A renewal
(:data:`LINKS_PER_COPY`) opens no window: the copy it replaces stays linkable until the new one is written.

Only tensors of the live module at least :data:`MIN_BYTES` large take part, and only when they add up to
:data:`MIN_TOTAL_BYTES`: below that a second file costs more than it saves. Sharing applies to local directories; a
remote (``scheme://``) path is written whole. These numbers are ``_limits``', read at each use.
"""

from __future__ import annotations

import os
import stat
import weakref
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import _copies as _frozen_copies
from . import _limits
from ._copies import Copy
from ._snapshot import Seen, Snapshot, copy_unchanged, nbytes, state, tensor
from ..format import CheckpointContents, data_path, save_checkpoint
from ..format._checksums import param_key
from ..format._shared_data import (NotShared, SavedData, SharedFrozen, SharedTooLarge, drop_name, looked_at,
                                  write_copy)
from ..format._store import Store, store_for
from ..format._writer import ExternalData

class FrozenSharing:
    """The sharing state of one plugin: the last save call's snapshot and, per directory, the independent copies of
    the frozen tensors that later saves may link.

    Redundancy: a save links the copy linked least recently, so that consecutive saves alternate between independent
    files (any two of them kept, every frozen byte is in two files); where fewer than :data:`COPIES` copies can be
    linked, it links the copy written in the background for it (:meth:`_plan`; waiting for it once it is due, and
    linking the one copy before: the window of :data:`ONE_COPY_SAVES` saves), or writes a fresh ``.data`` where none
    is on its way (the first save, a damaged copy, a link refused). A copy within two links of
    :data:`LINKS_PER_COPY` gets its successor written in the background (one damaged file takes at most that many
    checkpoints). Before a save links a copy, its bytes on disk are known good: read back and hashed against the
    recorded checksums when its identity changed (inode, size, modification time, or the change time without a
    change of link count: links and deletions are ours, and change both once done; one of our deletions under way,
    renamed away and not yet unlinked, explains a change time alone), on the save path, and every
    :data:`VERIFY_EVERY` saves in any case, in the background (reading the newest name of the copy that still
    opens: retention may delete names meanwhile); a copy that fails is never linked again (a warning names the
    checkpoints it took), and the save writes a fresh one.

    Retention may delete every checkpoint of one copy (a metric-ranked top-k keeps the best, whichever copy they
    link): :meth:`before_remove` then keeps that copy under a reserve name (``format._shared_data.keep_reserve``), and
    later saves link it like any other name; the reserve goes as soon as the copy is a checkpoint's again or
    :data:`COPIES` other copies are on disk. Reserves of an earlier run (or kept through a failed save) are adopted by
    the next save to the directory, and go once :data:`COPIES` copies of this run are on disk.
    """

    def __init__(self, trust_parameters: bool = False) -> None:
        self.trust_parameters = trust_parameters
        self._calls: dict[str, Snapshot] = {}
        self._copies: dict[str, list[Copy]] = {}
        self._saves: dict[str, int] = {}
        # tensors found changed although their version was not (BatchNorm's running statistics: its kernels update
        # them in place without bumping the counter): never shared again, always written inline
        self._volatile: set[str] = set()
        self._spares: dict[str, _frozen_copies.Spare] = {}  # per directory: the copy being written for later saves
        self._worker: ThreadPoolExecutor | None = None  # background copies and read-backs; stopped by close()
        self._unlinkable: set[str] = set()  # directories where the last link was refused: no copies written ahead

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
             kept: Collection[str] = (), store: Store | None = None) -> None:
        """Write ``ck`` to ``path`` through ``store`` (one that ``links``; by default the path's own) sharing what a
        copy of the directory holds unchanged, and remember what this save holds. ``kept``: frozen parameters of
        ``ck`` that are the live ones, not staged copies (an asynchronous save); those this save writes after all
        are copied first, and must not have changed since the call."""
        # a failed save leaves none: the next ones start fresh (adopting the reserves it left)
        copies = self._copies.pop(snap.directory, None) or _frozen_copies.orphans(snap.directory)
        count = self._saves[snap.directory] = self._saves.get(snap.directory, 0) + 1
        store = store if store is not None else store_for(path)
        try:
            self._save(ck, path, store, snap, external_data, kept, copies, count)
        except BaseException:
            for c in copies:  # forgotten: a copy written for this run that no save linked goes with them
                _frozen_copies.drop_temp(c)
            raise
        finally:
            snap.tensors.clear()
        self._plan(snap.directory, count, store)

    def _save(self, ck: CheckpointContents, path: str, store: Store, snap: Snapshot, external_data: ExternalData,
              kept: Collection[str], copies: list[Copy], count: int) -> None:
        chosen, spec = self._spec(ck, snap, copies, count, path)
        copied: set[str] = set()
        while True:
            linked = spec.names.keys() if spec is not None and spec.link_from is not None else set()
            for name in set(kept) - linked - copied:  # written after all: from a copy, as the rest of the save
                ck.frozen[name] = copy_unchanged(tensor(ck, name), snap, name, path)
                copied.add(name)
            try:
                saved = save_checkpoint(ck, path, store=store, external_data=external_data,
                                        shared=spec if not linked or spec is None else
                                        replace(spec, changed_since_asked=lambda n: not snap.still_live(n)))
                break
            except SharedTooLarge:  # the rest inline would pass 2 GiB: this save is written whole, as "auto" does
                saved = save_checkpoint(ck, path, store=store, external_data=external_data)
                break
            except NotShared as e:  # no link here, or tensors that changed unseen
                # a buffer is never shared again (a forward pass changes it unseen: BatchNorm's statistics); a
                # parameter changed through .data once: this save writes a fresh .data, and later ones share that
                self._volatile.update(n for n in e.names if n not in snap.params)
                if not e.names:
                    self._unlinkable.add(snap.directory)
                if not e.names or any(n in snap.params for n in e.names):
                    for c in copies:
                        _frozen_copies.drop_temp(c)
                    copies.clear()
                chosen, spec = self._spec(ck, snap, copies, count, path)
        if saved is not None:
            if saved.linked:
                self._unlinkable.discard(snap.directory)
            self._copies[snap.directory] = self._remember(path, snap, saved, copies, chosen, count)

    def _spec(self, ck: CheckpointContents, snap: Snapshot, copies: list[Copy], count: int,
              path: str) -> tuple[Copy | None, SharedFrozen | None]:
        """The copy this save links and how, or (None, a fresh ``.data``) while fewer than :data:`COPIES` copies
        can be linked; drops from ``copies`` those no name reaches any more and those that fail verification.

        The copy written in the background for this directory (:meth:`_plan`) joins ``copies`` when a save finds
        fewer than :data:`COPIES` to link, once it is due (waiting for it where it is not written yet); before it is
        due (the :data:`ONE_COPY_SAVES` saves after a fresh copy), those saves link the one copy there is."""
        while True:
            copies[:] = [c for c in copies if _frozen_copies.reachable(c)]
            linkable = []
            for c in copies:
                same = {n: c.offsets[n] for n in snap.live if n in c.offsets and n not in self._volatile
                        and snap.still(n, c.seen.get(n))}
                shared_bytes = nbytes(ck, same)
                if (shared_bytes * 2 >= c.size and shared_bytes >= _limits.MIN_TOTAL_BYTES
                        and c.links < _limits.LINKS_PER_COPY):
                    linkable.append((c, same))
            spare = self._spares.get(snap.directory)
            if len(linkable) < _limits.COPIES and spare is not None and count >= spare.due:
                del self._spares[snap.directory]
                _frozen_copies.resolve(spare, copies, path)
                continue
            if not linkable or (len(linkable) < _limits.COPIES and spare is None):
                break
            chosen, same = min(linkable, key=lambda item: item[0].used)
            source = _frozen_copies.checked(chosen, count, path, _limits.VERIFY_EVERY)
            if source is None:
                copies.remove(chosen)
                _frozen_copies.drop_reserves(chosen)  # damaged: its reserve holds the same bad bytes
                continue
            keys = [param_key(n) for n in same]
            trusted = frozenset(snap.params & same.keys()) if self.trust_parameters else frozenset()
            return chosen, SharedFrozen(same, source, chosen.names[source][0],
                                        {k: chosen.digests[k] for k in keys if k in chosen.digests}, trusted)
        names = set(snap.live) - self._volatile  # a fresh .data
        if nbytes(ck, names) < _limits.MIN_TOTAL_BYTES:
            return None, None
        return None, SharedFrozen.fresh(names)

    def _remember(self, path: str, snap: Snapshot, saved: SavedData, copies: list[Copy], chosen: Copy | None,
                  count: int) -> list[Copy]:
        data = data_path(os.path.abspath(path))
        for c in copies:  # this name now reaches what this save put there (the save deleted what it held before)
            if c.names.pop(data, None) is not None and c is not chosen:
                c.leaving += 1
        key = _frozen_copies.key_of(data)
        if saved.linked and chosen is not None and key is not None:
            _frozen_copies.drop_temp(chosen)  # a checkpoint's now
            _frozen_copies.restat(chosen)  # one more link: their ctime and count moved
            chosen.names[data] = key
            chosen.links += 1
            chosen.used = count
            chosen.seen.update({n: snap.live[n] for n in saved.offsets if n in snap.live})
        elif key is not None:
            copies.append(Copy({data: key}, saved.offsets, saved.digests, saved.layout,
                                {n: snap.live[n] for n in saved.offsets if n in snap.live}, saved.identity[2],
                                used=count, verified=count))
        copies = _frozen_copies.keep_two([c for c in copies if c.names], _limits.COPIES)
        for c in copies[:-_limits.REMEMBERED]:
            _frozen_copies.drop_reserves(c)
        return copies[-_limits.REMEMBERED:]

    def _plan(self, directory: str, count: int, store: Store) -> None:
        """After a save to ``directory``: start in the background what later saves will need, so that they do not
        wait for it: the read-back of a copy once 3/4 of :data:`VERIFY_EVERY` saves passed since its last (its result
        is taken by the save that links it next, waited for only where it is due and not done), and an independent
        copy of the newest one while fewer than :data:`COPIES` can be linked (after the first save of a directory) or
        one is within two links of :data:`LINKS_PER_COPY` (its renewal)."""
        copies = [c for c in self._copies.get(directory, []) if c.offsets and c.links < _limits.LINKS_PER_COPY]
        for c in copies:
            if c.checking is None and c.temp is None and count - c.verified >= _limits.VERIFY_EVERY * 3 // 4:
                names = _frozen_copies.by_age(c)
                c.checking = (count, names[0],
                              self._background(_frozen_copies.read_back, names, c.offsets, c.layout, c.digests))
        if not copies or directory in self._spares or directory in self._unlinkable or _limits.COPIES < 2:
            return
        first = len(copies) < _limits.COPIES
        if first or any(c.links >= _limits.LINKS_PER_COPY - 2 for c in copies):
            source = copies[-1]  # the newest: the tensors as they are now
            name = _frozen_copies.newest(source)
            tmp = store.temp_name(store.join(directory, "frozen-copy.data"))
            job = self._background(write_copy, name, source.names[name][0], tmp, source.offsets, source.layout,
                                   source.digests)
            due = count + 1 + (_limits.ONE_COPY_SAVES if first else 0)
            self._spares[directory] = _frozen_copies.Spare(count, due, source, tmp, job)

    def _background(self, fn: Any, *args: Any) -> Future[Any]:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ort-ckpt-frozen-copies")
        return self._worker.submit(fn, *args)

    def close(self) -> None:
        """At the plugin's teardown: wait for the background copies and read-backs, stop their thread, and delete
        the copies written for later saves that no save linked (the copies the checkpoints link stay)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
        for spare in self._spares.values():
            drop_name(spare.tmp)
        self._spares.clear()
        for directory, copies in self._copies.items():
            for c in copies:
                c.checking = None
                _frozen_copies.drop_temp(c)
            self._copies[directory] = [c for c in copies if c.names]

    def before_remove(self, path: str) -> None:
        """Before checkpoint ``path`` is deleted (on the thread that deletes it, just before): where its ``.data`` is
        the last name of a copy while a kept checkpoint links another and fewer than :data:`COPIES` other copies
        remain, keep that copy under a reserve name; drop the reserves no longer needed. The last name of a
        ``.data`` this plugin did not write (an earlier run's, before a resume) is kept the same way, until
        :data:`COPIES` copies of this run are on disk."""
        path = os.path.abspath(path)
        directory, data = os.path.dirname(path), data_path(path)
        copies = self._copies.get(directory)
        if not copies:
            return
        if not any(data in c.names for c in copies):
            key, st = _frozen_copies.key_of(data), looked_at(data)
            if key is None or st is None or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                return
            copies.insert(0, Copy({data: key}, {}, {}, {}, {}, st.st_size, used=0, verified=0))
        self._copies[directory] = _frozen_copies.keep_two(copies, _limits.COPIES, gone=data)
        for c in self._copies[directory]:
            if data in c.names:
                c.leaving += 1


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

    def write(self, ck: CheckpointContents, path: str, kept: Collection[str], store: Store) -> None:
        """Write ``ck`` to ``path``; ``kept``: the frozen parameters of :attr:`keep` that it holds live, not staged."""
        if self.snap is None:
            save_checkpoint(ck, path, store=store, external_data=self.external_data)
        else:
            self.sharing.save(ck, path, self.snap, self.external_data, kept, store)

