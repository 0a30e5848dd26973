"""The independent copies of a directory's frozen tensors, as one plugin's frozen sharing tracks them
(``_sharing`` decides which a save links): each copy's names and what they were when last looked at, whether its
bytes on disk are known good (read back against the checksums, in the background or when due), the reserve names
that keep a copy no checkpoint names, and what is done when one is found damaged (``format._shared_data.repair``:
a fresh copy from good bytes, the checkpoints that linked the damaged one relinked to it).
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import Future
from dataclasses import dataclass

from ._snapshot import Seen
from ..errors import CheckpointWarning
from ..format._shared_data import (Identity, drop_name, identity, is_reserve, keep_reserve, looked_at, repair,
                                  reserves, sharing_checkpoints, verify_data)


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
