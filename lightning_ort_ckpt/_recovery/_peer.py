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

At ``setup``, before "last" is read: every rank says (one all-gather) the newest step in its fast folder and the
newest peer copy it holds; a rank whose partner holds a newer step than its own folder gets it back over the group
and commits it into its fast folder (:meth:`Peers.restore`), so that "last" then finds it there: nothing of the
persistent tier is read. Here, full-state saves (one file, written by global rank 0: DDP, one device, FSDP with
full state); a sharded strategy's folders: ``_peer_folders``.
"""

from __future__ import annotations

import os
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

    # -- at setup ---------------------------------------------------------------------------------------------
    def restore(self) -> None:
        """Take back from the partner the copy of a step newer than any in this rank's own fast folder (every rank
        alike: one all-gather of what each holds, then one exchange)."""
        own = self._newest(self.dirpath)
        held = self._newest(self.store.join(self.dirpath, f"{PEER_PREFIX}{self.source}"))
        reports = self.wire.gather({"own": own and own[0], "held": held and held[0]})

        def needs(rank: int) -> bool:
            copy = reports[partners(rank, self.world_size, *self.layout)[0]]["held"]
            return copy is not None and (reports[rank]["own"] is None or copy > reports[rank]["own"])

        outgoing = [(os.path.basename(held[1]), held[1])] if held and needs(self.source) else []
        self.wire.exchange(to=self.source, frm=self.partner, outgoing=outgoing, folder=self.dirpath)

    def _newest(self, folder: str) -> tuple[int, str] | None:
        """(step, path) of the newest committed checkpoint file in ``folder``, or None."""
        if not self.store.is_directory(folder):
            return None
        found = [(step, e.path) for e in _registry.committed(_registry.scan(folder, self.store,
                                                                              extension=self.extension))
                 if e.kind is _registry.Kind.FILE and (step := e.step) is not None]
        return max(found) if found else None

    def _rotate(self, folder: str) -> None:
        """A peer folder keeps the newest ``keep`` copies, as the fast tier does."""
        found = sorted(((e.step if e.step is not None else -1, e.path) for e in _registry.committed(
            _registry.scan(folder, self.store, extension=self.extension))), reverse=True)
        for _, path in found[self.keep:]:
            self.store.remove(path)
