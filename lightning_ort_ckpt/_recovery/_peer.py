"""Peer copies of the fast tier (``LocalTier(peer=True)``; Gemini's copies in a partner's memory, here on its disk).

A node replaced after a failure comes back with an empty fast folder. With peer copies, each fast-tier save is also
sent to a partner rank, on another node where there is one (``node_rank`` apart: rank ``r`` sends to
``(r + devices) % world_size``; on one node, to the next rank), over a gloo process group of its own (``_peer_wire``:
made at the fast tier's ``setup``, destroyed at the end of the fit), and the partner commits it in its fast folder
under ``peer-of-rank<r>/``, with the store's atomic commit, every checksum verified, keeping as many as the fast
tier keeps. The plugin's executor hands each save's exchange, once the save is committed, to a thread of the fast
tier's own, so that saves never wait for copies; the exchange is one symmetric step (every rank sends its file of
the step, maybe none, to its partner and receives its own peer's), taken by every rank in the same order of steps,
so it cannot deadlock. A copy that falls behind by more than ``keep`` saves finds the file rotated out and sends
nothing: the cost stays bounded, and the newest steps are copied.

The ranks of a node share its fast folder (a node-local disk). Each folder has one keeper, the lowest rank whose
folder it is (found at ``setup``: one all-gather of which folder each rank's is, :func:`folder_identity`): it
alone commits what ``setup`` takes back into the folder and rotates it, so that no two ranks commit the same file
into one folder, nor remove it, at once. A rank's copies (``peer-of-rank<r>/``: ``r`` its source) are its own.

At ``setup`` of a fit that resumes from "last", before "last" is read (a fit that does not takes nothing back): every
rank says (one all-gather) which steps its fast folder and its peer folders hold; the newest of them is committed in
every fast folder that lacks it, by its keeper, from a copy in the folder where it holds one, else over the group
from a rank that does (:meth:`Peers.restore`): a replaced node's empty folder, and under DDP every node's folder but
rank 0's, whose ranks then resume by rank 0's path from their own node. "last" finds it there: nothing of the persistent
tier is read. Here, full-state saves (one file, written by global rank 0: DDP, one device, FSDP with full state);
a sharded strategy's folders: ``_peer_folders``.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ._peer_wire import Wire
from .._restore import _registry
from .._saving._async_saver import BackgroundQueue
from ..format._store import Store

PEER_PREFIX = "peer-of-rank"  # the sub-folder of a fast folder holding rank N's copies: "peer-of-rank<N>"


def partners(rank: int, world_size: int, per_node: int, num_nodes: int) -> tuple[int, int]:
    """(the rank ``rank`` sends its copies to, the rank whose copies it holds): on another node where there is one."""
    shift = per_node if num_nodes > 1 else 1
    return (rank + shift) % world_size, (rank - shift) % world_size


class Peers:
    """One fast tier's exchanges with its partner ranks, over a gloo group of its own, for one fit."""

    def __init__(self, dirpath: str, store: Store, keep: int, extension: str, trainer: Any) -> None:
        self.dirpath, self.store, self.keep, self.extension = dirpath, store, keep, extension
        self.rank, self.world_size = trainer.global_rank, trainer.world_size
        self.layout = (trainer.num_devices, trainer.num_nodes)  # devices per node, nodes
        self.partner, self.source = partners(self.rank, self.world_size, *self.layout)
        self.wire = Wire(store, self.world_size)
        folders = self.wire.gather(folder_identity(dirpath))
        self.keepers = [folders.index(folder) for folder in folders]  # each rank's folder's keeper (module doc)
        self.keeper = self.keepers[self.rank]
        self.queue = BackgroundQueue()  # the exchanges, in the order of the saves

    def close(self) -> None:
        """Run the exchanges handed over (the caller waited for the plugin's queue first), stop the thread, let go
        of the group; then raise the first error of an exchange."""
        self.queue.close()
        self.wire.close()
        error = self.queue.take_error()
        if error is not None:
            raise error

    # -- after a save -----------------------------------------------------------------------------------------
    def hand_off(self, path: str, writes: bool) -> None:
        """The save of ``path`` is committed (called where the plugin's saves run): its exchange, on our thread."""
        self.queue.submit(self.replicate, path, writes)

    def replicate(self, path: str, writes: bool) -> None:
        """Send this rank's fast file ``path`` (``writes``: this rank wrote it), where it is still there, to the
        partner, and commit the one the source sends (every rank alike, in the order of the saves)."""
        mine = [(os.path.basename(path), path)] if writes else []
        folder = self.store.join(self.dirpath, f"{PEER_PREFIX}{self.source}")
        if self.wire.exchange(to=self.partner, frm=self.source, outgoing=mine, folder=folder):
            self._rotate(folder)
        if self.rank == self.keeper != 0:  # what setup copied here (rank 0's folder rotates with the fast tier's
            self._rotate(self.dirpath)  # ledger)

    # -- at setup ---------------------------------------------------------------------------------------------
    def restore(self) -> None:
        """The newest step of any rank's fast folder or copies, committed in every fast folder that lacks it (a
        wiped one's; under DDP, every node's but rank 0's, which resume from it by rank 0's path) by its keeper:
        copied from a copy in the folder where it holds it, else sent by a rank that does (every rank alike: one
        all-gather of what each holds, then the transfers in one order); every folder done when it returns."""
        reports = self.wire.gather(self._holdings())
        held = [(int(step), name) for report in reports for place in report.values() for step, name in place.items()]
        if held:
            step, name = max(held)
            for src, dst, where in plan(reports, str(step), name, [name], self.keepers):
                self.transfer(src, dst, where, name)
        self.wire.barrier()  # a rank that is no keeper lists its folder (for "last") once its keeper filled it

    def _holdings(self) -> dict[str, dict[str, str]]:
        """Where this rank holds which step: {"" (its own folder) or a peer folder's name: {step: file name}}."""
        places = [""] + sorted(p for p in os.listdir(self.dirpath) if p.startswith(PEER_PREFIX))
        held: dict[str, dict[str, str]] = {}
        for place in places:
            folder = self.store.join(self.dirpath, place) if place else self.dirpath
            held[place] = {str(e.step): os.path.basename(e.path) for e in _registry.committed(
                _registry.scan(folder, self.store, extension=self.extension))
                if e.kind is _registry.Kind.FILE and e.step is not None}
        return held

    def transfer(self, src: int, dst: int, where: str, name: str) -> None:
        """The file ``where`` (relative to ``src``'s fast folder) committed as ``name`` in ``dst``'s: copied on
        its node, or sent by ``src``."""
        if src == dst == self.rank:
            self.wire.copy(self.store.join(self.dirpath, where), self.store.join(self.dirpath, name))
        elif src == self.rank:
            self.wire.exchange(to=dst, frm=dst, outgoing=[(name, self.store.join(self.dirpath, where))],
                               folder=self.dirpath)
        elif dst == self.rank:
            self.wire.exchange(to=src, frm=src, outgoing=[], folder=self.dirpath)

    def _rotate(self, folder: str) -> None:
        """A folder of copies keeps the newest ``keep``, as the fast tier does."""
        found = sorted(((e.step if e.step is not None else -1, e.path) for e in _registry.committed(
            _registry.scan(folder, self.store, extension=self.extension)) if e.kind is _registry.Kind.FILE),
            reverse=True)
        for _, path in found[self.keep:]:
            self.store.remove(path)


def folder_identity(path: str) -> list[Any]:
    """Which folder ``path`` is, alike in every process that sees it: the machine (its boot id, else its host name)
    and the folder's device and inode (``/proc/self/cwd/...`` is the process's own folder, ``/dev/shm`` its
    container's)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = f.read().strip()
    except OSError:
        machine = socket.gethostname()
    found = os.stat(path)
    return [machine, found.st_dev, found.st_ino]


def plan(reports: list[dict[str, dict[str, Any]]], step: str, unit: str, files: list[str],
         keepers: list[int]) -> list[tuple[int, int, str]]:
    """(from rank, to rank, where the sender holds it: relative to its fast folder) for each of ``files`` of the
    checkpoint ``unit`` (a file, or a folder) of ``step`` that a fast folder lacks, to the folder's keeper only
    (``keepers[r]``: the rank that fills rank ``r``'s folder), in one order every rank computes alike: from the
    keeper's own copies where it holds them, else from the first rank that holds it. ``reports``: each rank's
    holdings, {"" or a peer folder: {step: names there (a file's, or a folder's files)}}."""
    def places(report: dict[str, dict[str, Any]], file: str) -> list[str]:
        return [place for place, held in sorted(report.items()) if step in held and
                (file in held[step] if isinstance(held[step], list) else file == held[step])]

    transfers = []
    for dst, report in enumerate(reports):
        if keepers[dst] != dst:  # a folder of a lower rank too: filled by that rank
            continue
        for file in files:
            mine = places(report, file)
            if "" in mine:
                continue
            src = dst if mine else next(r for r, other in enumerate(reports) if places(other, file))
            where = places(reports[src], file)[0]
            inner = f"{unit}/{file}" if unit != file else file
            transfers.append((src, dst, f"{where}/{inner}" if where else inner))
    return transfers
