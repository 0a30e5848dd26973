"""The independent copies of a directory's frozen tensors, as one plugin's frozen sharing tracks them, and every
choice about them (:class:`Copies`: which a save links, what is written or read back ahead, what retention must keep):
each copy's names and what they were when last looked at, whether its bytes on disk are known good (read back against
the checksums, in the background or when due), the reserve names that keep a copy no checkpoint names, and what is
done when one is found damaged (``format._shared_data.repair``: a fresh copy from good bytes, the checkpoints that
linked the damaged one relinked to it). Their files are touched only through ``format._shared_data``.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from . import _limits
from ._snapshot import Seen, Snapshot, nbytes
from ..errors import CheckpointWarning
from ..format import CheckpointContents, data_path
from ..format._checksums import param_key
from ..format._shared_data import (Identity, SavedData, SharedFrozen, drop_name, identity, is_reserve, keep_reserve,
                                   looked_at, repair, reserves, sharing_checkpoints, verify_data, write_copy)
from ..format._store import Store


Key = tuple[Identity, int, int]  # a .data name's identity, ctime and link count when last looked at


@dataclass
class Copy:
    """One ``.data`` file a sharing save wrote fresh (an independent copy of the frozen tensors) and the names of
    the later saves that link (or clone) it."""

    names: dict[str, Key]  # .data path -> what it was when last looked at (a clone is an inode of its own)
    offsets: dict[str, int]
    digests: dict[str, int]
    layout: dict[str, tuple[int, tuple[int, ...], int]]
    seen: dict[str, Seen]
    size: int
    used: int  # the directory's save count when it was last written or linked (the least recently used is next)
    verified: int  # the save count when its bytes on disk were last read back and matched their checksums
    links: int = 0
    temp: str | None = None  # a copy written in the background: its hidden name until a save links it
    checking: tuple[int, str, Future[tuple[Identity | None, list[str]]]] | None = None  # a background read-back:
    # the save count it started at, the name it reads first, its result
    leaving: int = 0  # our deletions of its names announced (before_remove, a save replacing one) since they were
    # last recorded: a deletion renames the name away first and unlinks it later, so meanwhile the change time moves
    # with the link count unchanged


@dataclass
class Spare:
    """An independent copy of ``source`` being written in the background to the hidden name ``tmp`` (and read
    back), for the save that would otherwise write the frozen part fresh: from save ``due`` on, a save that finds
    fewer than ``wanted`` copies to link waits for it rather than write one."""

    since: int
    due: int
    source: Copy
    tmp: str
    job: Future[tuple[bool, list[str]]]



def key_of(data: str) -> Key | None:
    st = looked_at(data)
    return None if st is None else (identity(st), st.st_ctime_ns, st.st_nlink)


def reachable(copy: Copy) -> bool:
    """Forget the names of ``copy`` that are another file now (replaced, deleted); whether any is left."""
    for name, (ident, _, _) in list(copy.names.items()):
        now = key_of(name)
        if now is None or now[0][:2] != ident[:2]:
            del copy.names[name]
    return bool(copy.names)


def restat(copy: Copy) -> None:
    """Record the names of ``copy`` again after our own link or deletion moved their change time and link count
    (only those still the very file: a name whose size or modification time moved stays as it was, and is read
    back before it is linked)."""
    for name, (ident, _, _) in list(copy.names.items()):
        now = key_of(name)
        if now is not None and now[0] == ident:
            copy.names[name] = now
    copy.leaving = 0


def keep_two(copies: list[Copy], wanted: int, gone: str | None = None) -> list[Copy]:
    """The copies still on disk, a reserve name kept for each that no checkpoint names any more (``gone`` is about
    to be deleted) while a checkpoint links another and fewer than ``wanted`` others remain, and dropped from the
    rest. The oldest are looked at first: where one must go, the newer copies stay."""
    copies = [c for c in copies if reachable(c)]
    for c in copies:
        named = any(n != gone and not is_reserve(n) for n in c.names)
        others = [o for o in copies if o is not c and o.offsets and any(n != gone for n in o.names)]
        linked = any(n != gone and not is_reserve(n) for o in others for n in o.names)
        held = [n for n in c.names if is_reserve(n)]
        # an adopted reserve (no offsets: an earlier run's) is kept until ``wanted`` copies of this run are on disk
        needed = not named and len(others) < wanted and (linked or not c.offsets)
        if needed and not held:
            source = next(n for n in c.names)
            name = keep_reserve(source, c.names[source][0])
            if name is not None:
                c.names[name] = c.names[source]
                restat(c)
        elif held and not needed:
            drop_reserves(c)
    return [c for c in copies if c.names]


def drop_reserves(copy: Copy) -> None:
    """Delete the reserve names of ``copy``, and the hidden name of one written in the background (the inode goes
    with the last)."""
    drop_temp(copy)
    held = [n for n in copy.names if is_reserve(n)]
    for name in held:
        drop_name(name)
        del copy.names[name]
    if held:
        restat(copy)


def orphans(directory: str) -> list[Copy]:
    """The reserves in ``directory`` no copy of this plugin tracks (an earlier run's, or kept through a failed save),
    as copies no save links: kept until ``wanted`` copies of this run are on disk."""
    found = []
    for name in reserves(directory):
        key = key_of(name)
        if key is not None:
            found.append(Copy({name: key}, {}, {}, {}, {}, key[0][2], used=0, verified=0))
    return found


def by_age(copy: Copy) -> list[str]:
    """The names of ``copy``, newest first: by modification time (a clone is an inode of its own), then the name
    linked last (retention deletes the oldest checkpoints first)."""
    return sorted(reversed(list(copy.names)), key=lambda n: copy.names[n][0][3], reverse=True)


def newest(copy: Copy) -> str:
    """The newest name of ``copy``."""
    return by_age(copy)[0]


def read_back(names: list[str], offsets: dict[str, int], layout: dict[str, tuple[int, tuple[int, ...], int]],
               digests: dict[str, int]) -> tuple[Identity | None, list[str]]:
    """:func:`verify_data` of the first of ``names`` that still opens (on the worker thread: retention may have
    deleted the others since the read-back was asked for)."""
    for name in names:
        found, bad = verify_data(name, offsets, layout, digests)
        if found is not None:
            return found, bad
    return None, []


def _moved(then: Key, now: Key, copy: Copy) -> bool:
    """Whether a ``.data`` name of ``copy`` changed since it was last looked at other than by our own links and
    deletions: the change time moved with the link count unchanged while none of ours was under way."""
    return now[0] != then[0] or (now[1] != then[1] and now[2] == then[2] and not copy.leaving)


def _trust(copy: Copy, now: Key, count: int) -> None:
    """Record the names of the inode ``now`` (just read back, its bytes matched) as they are now, verified at
    ``count``."""
    for name, (ident, _, _) in list(copy.names.items()):
        if ident[:2] == now[0][:2]:
            copy.names[name] = now
    copy.leaving = 0
    copy.verified = max(copy.verified, count)


def checked(copy: Copy, count: int, path: str, verify_every: int) -> str | None:
    """A name of ``copy`` whose bytes are known good, read back and verified when its identity changed or
    ``verify_every`` saves passed; None (with a warning, the checkpoints linking it repaired) when they are not. A
    read-back started in the background counts from the save that started it, if the name it read did not change
    since; it is waited for where it is due."""
    source = newest(copy)
    if copy.checking is not None:
        since, name, job = copy.checking
        if job.done() or count - copy.verified >= verify_every:
            copy.checking = None
            found, bad = job.result()
            # the name it read, or (retention deleted that one) another name of the same inode
            same = sorted((n for n in copy.names if copy.names[n][0] == found), key=lambda n: n != name)
            now = key_of(same[0]) if same else None
            if now is not None and found == now[0] and not _moved(copy.names[same[0]], now, copy):
                if bad:
                    _warn_damaged(same[0], bad, path)
                    return None
                _trust(copy, now, since)
                source = same[0]
    then, now = copy.names[source], key_of(source)
    if now is None:
        return None
    changed = _moved(then, now, copy)
    if not changed and count - copy.verified < verify_every:
        return source
    found, bad = verify_data(source, copy.offsets, copy.layout, copy.digests)
    if found is None or bad or found != now[0]:
        _warn_damaged(source, bad, path)
        return None
    _trust(copy, now, count)
    return source


def resolve(spare: Spare, copies: list[Copy], path: str) -> None:
    """Add the copy written in the background to ``copies`` (waiting for it where it is not written yet), never
    linked before, so the next to link; where its source was found damaged while it was copied, drop that."""
    written, bad = spare.job.result()
    source = spare.source
    key = key_of(spare.tmp) if written else None
    if key is not None:
        copies.append(Copy({spare.tmp: key}, source.offsets, source.digests, source.layout, dict(source.seen),
                            source.size, used=-1, verified=spare.since, temp=spare.tmp))
    elif bad and source in copies:
        _warn_damaged(newest(source), bad, path)
        copies.remove(source)
        drop_reserves(source)


def _warn_damaged(source: str, bad: list[str], path: str) -> None:
    """Repair the checkpoints linking the damaged ``.data`` ``source`` (a fresh copy from good bytes, relinked:
    ``format._shared_data.repair``) and say so, naming them."""
    linking = sharing_checkpoints(source[:-len(".data")])
    done = repair(linking)
    lost = [n for r in done for n in r.lost]
    fixed = [c for r in done for c in r.checkpoints]
    what = (f"frozen tensor {bad[0]!r} ({len(bad)} in all) no longer matches the checksum recorded when it was "
            f"written" if bad else "it could not be read back")
    then = (f"{len(fixed)} checkpoint(s) linking to it were repaired (relinked to a fresh copy written from good "
            f"bytes): {', '.join(os.path.basename(p) for p in fixed)}" if fixed else
            f"tensor {lost[0]!r} is damaged in every copy: the checkpoints linking to it cannot be loaded: "
            f"{', '.join(os.path.basename(p) for p in linking)}" if lost else "no checkpoint links to it any more")
    warnings.warn(f"{source}: this shared .data is damaged ({what}); {path} gets a fresh copy instead, and no "
                  f"save links to it again; {then}", CheckpointWarning, stacklevel=5)


def drop_temp(copy: Copy) -> None:
    """Delete the hidden name of a copy written in the background (once a checkpoint links it, or when it is
    forgotten)."""
    if copy.temp is not None:
        drop_name(copy.temp)
        copy.names.pop(copy.temp, None)
        copy.temp = None


class Worker:
    """The one thread of a plugin's frozen sharing for the background copies and read-backs: started on first need,
    stopped by :meth:`close` (at the plugin's teardown), which waits for it; nothing at import, nothing global."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ort-ckpt-frozen-copies")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class Copies:
    """The independent copies of one directory's frozen tensors that a plugin tracks, and every choice about them:
    which one a save links (:meth:`choose`), what it leaves to the next (:meth:`record`: the copy it wrote or linked,
    and what is started ahead in the background), what retention must not take (:meth:`before_remove`).

    Redundancy: a save links the copy linked least recently, so that consecutive saves alternate between independent
    files (any two of them kept, every frozen byte is in two files); where fewer than ``COPIES`` copies can be
    linked, it links the copy written in the background for it (waiting for it once it is due, and linking the one
    copy before: the window of ``ONE_COPY_SAVES`` saves), or writes a fresh ``.data`` where none is on its way (the
    first save, a damaged copy, a link refused). A copy within two links of ``LINKS_PER_COPY`` gets its successor
    written in the background (one damaged file takes at most that many checkpoints). Before a save links a copy, its
    bytes on disk are known good: read back and hashed against the recorded checksums when its identity changed
    (inode, size, modification time, or the change time without a change of link count: links and deletions are
    ours, and change both once done; one of our deletions under way, renamed away and not yet unlinked, explains a
    change time alone), on the save path, and every ``VERIFY_EVERY`` saves in any case, in the background (reading the
    newest name of the copy that still opens: retention may delete names meanwhile); a copy that fails is never
    linked again (a warning names the checkpoints it took, which are repaired), and the save writes a fresh one.
    (The numbers are ``_limits``'.)

    Retention may delete every checkpoint of one copy (a metric-ranked top-k keeps the best, whichever copy they
    link): :meth:`before_remove` then keeps that copy under a reserve name (``format._shared_data.keep_reserve``), and
    later saves link it like any other name; the reserve goes as soon as the copy is a checkpoint's again or
    ``COPIES`` other copies are on disk. Reserves of an earlier run (or kept through a failed save) are adopted by the
    next save to the directory, and go once ``COPIES`` copies of this run are on disk.
    """

    def __init__(self, directory: str, worker: Worker) -> None:
        self.directory = directory
        self._worker = worker  # the plugin's: background copies and read-backs
        self.copies: list[Copy] | None = None  # None while a save is under way, and after a failed one (the next
        # starts afresh, adopting the reserves it left)
        self.count = 0  # the directory's saves
        self.spare: Spare | None = None  # the copy being written for later saves
        self.unlinkable = False  # the last link was refused here: no copies written ahead
        self._saving: list[Copy] = []  # the copies of the save under way

    def begin(self) -> None:
        """A save of the directory starts: it works on the copies tracked (else the reserves on disk), which the
        directory forgets should it fail."""
        self._saving = self.copies or orphans(self.directory)
        self.copies = None
        self.count += 1

    def forget(self) -> None:
        """The save failed: the copies are forgotten (a copy written for this run that no save linked goes with
        them)."""
        for c in self._saving:
            drop_temp(c)
        self._saving = []

    def refused(self, link: bool, all_copies: bool) -> None:
        """The writer refused the plan (``NotShared``): ``link``, no link can be made here; ``all_copies``, no copy
        may be linked by this save (a link refused, a parameter changed through ``.data``)."""
        if link:
            self.unlinkable = True
        if all_copies:
            for c in self._saving:
                drop_temp(c)
            self._saving.clear()

    def choose(self, ck: CheckpointContents, snap: Snapshot, volatile: Collection[str], trust: bool,
               path: str) -> tuple[Copy | None, SharedFrozen | None]:
        """The copy this save links and the plan for it, or (None, a fresh ``.data``) while fewer than ``COPIES``
        copies can be linked, or (None, None) where too little is left to share; drops the copies no name reaches
        any more and those that fail verification. ``volatile``: tensors never shared; ``trust``: frozen parameters
        taken on torch's word (not hashed again).

        The copy written in the background (:meth:`record`) joins when a save finds fewer than ``COPIES`` to link,
        once it is due (waiting for it where it is not written yet); before it is due (the ``ONE_COPY_SAVES`` saves
        after a fresh copy), those saves link the one copy there is."""
        copies = self._saving
        while True:
            copies[:] = [c for c in copies if reachable(c)]
            linkable = []
            for c in copies:
                same = {n: c.offsets[n] for n in snap.live if n in c.offsets and n not in volatile
                        and snap.still(n, c.seen.get(n))}
                shared_bytes = nbytes(ck, same)
                if (shared_bytes * 2 >= c.size and shared_bytes >= _limits.MIN_TOTAL_BYTES
                        and c.links < _limits.LINKS_PER_COPY):
                    linkable.append((c, same))
            spare = self.spare
            if len(linkable) < _limits.COPIES and spare is not None and self.count >= spare.due:
                self.spare = None
                resolve(spare, copies, path)
                continue
            if not linkable or (len(linkable) < _limits.COPIES and spare is None):
                break
            chosen, same = min(linkable, key=lambda item: item[0].used)
            source = checked(chosen, self.count, path, _limits.VERIFY_EVERY)
            if source is None:
                copies.remove(chosen)
                drop_reserves(chosen)  # damaged: its reserve holds the same bad bytes
                continue
            keys = [param_key(n) for n in same]
            trusted = frozenset(snap.params & same.keys()) if trust else frozenset()
            return chosen, SharedFrozen(same, source, chosen.names[source][0],
                                        {k: chosen.digests[k] for k in keys if k in chosen.digests}, trusted)
        names = set(snap.live) - set(volatile)  # a fresh .data
        if nbytes(ck, names) < _limits.MIN_TOTAL_BYTES:
            return None, None
        return None, SharedFrozen.fresh(names)

    def record(self, path: str, snap: Snapshot, saved: SavedData, chosen: Copy | None, store: Store) -> None:
        """After the save to ``path`` put ``saved`` in its ``.data`` (linking ``chosen``, or a fresh file): the copies
        the next saves choose from, and what they will need started in the background (:meth:`_ahead`)."""
        copies = self._saving
        self._saving = []
        if saved.linked:
            self.unlinkable = False
        data = data_path(os.path.abspath(path))
        for c in copies:  # this name now reaches what this save put there (the save deleted what it held before)
            if c.names.pop(data, None) is not None and c is not chosen:
                c.leaving += 1
        key = key_of(data)
        if saved.linked and chosen is not None and key is not None:
            drop_temp(chosen)  # a checkpoint's now
            restat(chosen)  # one more link: their ctime and count moved
            chosen.names[data] = key
            chosen.links += 1
            chosen.used = self.count
            chosen.seen.update({n: snap.live[n] for n in saved.offsets if n in snap.live})
        elif key is not None:
            copies.append(Copy({data: key}, saved.offsets, saved.digests, saved.layout,
                               {n: snap.live[n] for n in saved.offsets if n in snap.live}, saved.identity[2],
                               used=self.count, verified=self.count))
        copies = keep_two([c for c in copies if c.names], _limits.COPIES)
        for c in copies[:-_limits.REMEMBERED]:
            drop_reserves(c)
        self.copies = copies[-_limits.REMEMBERED:]
        self._ahead(store)

    def _ahead(self, store: Store) -> None:
        """Start in the background what later saves will need, so that they do not wait for it: the read-back of a
        copy once 3/4 of ``VERIFY_EVERY`` saves passed since its last (its result is taken by the save that links it
        next, waited for only where it is due and not done), and an independent copy of the newest one while fewer
        than ``COPIES`` can be linked (after the first save of a directory) or one is within two links of
        ``LINKS_PER_COPY`` (its renewal)."""
        count = self.count
        copies = [c for c in self.copies or [] if c.offsets and c.links < _limits.LINKS_PER_COPY]
        for c in copies:
            if c.checking is None and c.temp is None and count - c.verified >= _limits.VERIFY_EVERY * 3 // 4:
                names = by_age(c)
                c.checking = (count, names[0], self._worker.submit(read_back, names, c.offsets, c.layout, c.digests))
        if not copies or self.spare is not None or self.unlinkable or _limits.COPIES < 2:
            return
        first = len(copies) < _limits.COPIES
        if first or any(c.links >= _limits.LINKS_PER_COPY - 2 for c in copies):
            source = copies[-1]  # the newest: the tensors as they are now
            name = newest(source)
            tmp = store.temp_name(store.join(self.directory, "frozen-copy.data"))
            job = self._worker.submit(write_copy, name, source.names[name][0], tmp, source.offsets, source.layout,
                                      source.digests)
            due = count + 1 + (_limits.ONE_COPY_SAVES if first else 0)
            self.spare = Spare(count, due, source, tmp, job)

    def before_remove(self, path: str) -> None:
        """Before checkpoint ``path`` of the directory is deleted: where its ``.data`` is the last name of a copy
        while a kept checkpoint links another and fewer than ``COPIES`` other copies remain, keep that copy under a
        reserve name; drop the reserves no longer needed. The last name of a ``.data`` this plugin did not write (an
        earlier run's, before a resume) is kept the same way, until ``COPIES`` copies of this run are on disk."""
        data = data_path(path)
        copies = self.copies
        if not copies:
            return
        if not any(data in c.names for c in copies):
            key, st = key_of(data), looked_at(data)
            if key is None or st is None or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                return
            copies.insert(0, Copy({data: key}, {}, {}, {}, {}, st.st_size, used=0, verified=0))
        self.copies = keep_two(copies, _limits.COPIES, gone=data)
        for c in self.copies:
            if data in c.names:
                c.leaving += 1

    def close(self) -> None:
        """At the plugin's teardown, its worker stopped: delete the copy written for later saves that no save linked
        (the copies the checkpoints link stay)."""
        if self.spare is not None:
            drop_name(self.spare.tmp)
            self.spare = None
        if self.copies is not None:
            for c in self.copies:
                c.checking = None
                drop_temp(c)
            self.copies = [c for c in self.copies if c.names]
