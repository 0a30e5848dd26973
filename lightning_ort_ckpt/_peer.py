"""Peer copies of the fast tier (``LocalTier(peer=True)``; Gemini's copies in a partner's memory, here on its disk).

A node replaced after a failure comes back with an empty fast folder. With peer copies, each fast-tier save is also
sent to a partner rank, on another node where there is one (``node_rank`` apart: rank ``r`` sends to
``(r + devices) % world_size``; on one node, to the next rank), over a gloo process group of its own (made at the
fast tier's ``setup``, destroyed at the end of the fit), and the partner commits it in its fast folder under
``peer-of-rank<r>/``, with the store's atomic commit, every checksum verified, keeping as many as the fast tier keeps.
The exchange runs where the plugin's saves run (its background thread with ``async_save=True``), after the save is
committed; it is one symmetric step (every rank sends its files of the step, maybe none, to its partner and receives
its own peer's), posted by every rank in the same order of steps, so it cannot deadlock; the group's timeout bounds
a rank that never comes.

At ``setup``, before "last" is read: every rank says (one all-gather) the newest step in its fast folder and the
newest peer copy it holds; a rank whose partner holds a newer step than its own folder gets it back over the group
and commits it into its fast folder (:meth:`Peers.restore`), so that "last" then finds it there: nothing of the
persistent tier is read. Only full-state saves (one file, written by global rank 0: DDP, one device) are copied in
this version; the sharded strategies' folders are not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, BinaryIO

from . import _registry
from .errors import CorruptCheckpointError
from .format import data_path, open_checkpoint
from .format._store import Store

PEER_PREFIX = "peer-of-rank"  # the sub-folder of a fast folder holding rank N's copies: "peer-of-rank<N>"
TIMEOUT = timedelta(minutes=3)  # a partner that never takes part in an exchange: the exchange fails after this
_CHUNK = 16 << 20  # bytes sent at a time


def partners(rank: int, world_size: int, per_node: int, num_nodes: int) -> tuple[int, int]:
    """(the rank ``rank`` sends its copies to, the rank whose copies it holds): on another node where there is one."""
    shift = per_node if num_nodes > 1 else 1
    return (rank + shift) % world_size, (rank - shift) % world_size


class Peers:
    """One fast tier's exchanges with its partner ranks, over a gloo group of its own, for one fit."""

    def __init__(self, dirpath: str, store: Store, keep: int, extension: str, trainer: Any) -> None:
        import torch.distributed as dist  # the process group is up by setup

        self.dirpath, self.store, self.keep, self.extension = dirpath, store, keep, extension
        self.rank, self.world_size = trainer.global_rank, trainer.world_size
        self.layout = (trainer.num_devices, trainer.num_nodes)  # devices per node, nodes
        self.partner, self.source = partners(self.rank, self.world_size, *self.layout)
        self.group: Any = dist.new_group(backend="gloo", timeout=TIMEOUT)

    def close(self) -> None:
        """Let go of the group (every exchange has run: the caller waited for the plugin's queue)."""
        if self.group is not None:
            import torch.distributed as dist

            group, self.group = self.group, None
            dist.destroy_process_group(group)

    # -- after a save -----------------------------------------------------------------------------------------
    def replicate(self, path: str, writes: bool) -> None:
        """Send this rank's committed fast file ``path`` (``writes``: this rank wrote it) to the partner, and commit
        the one the source sends (run after the save, where the plugin's saves run, on every rank alike)."""
        mine = [path] if writes and self.store.exists(path) else []
        self._exchange(to=self.partner, frm=self.source, outgoing=mine,
                       folder=self.store.join(self.dirpath, f"{PEER_PREFIX}{self.source}"))

    # -- at setup ---------------------------------------------------------------------------------------------
    def restore(self) -> bool:
        """Take back from the partner the copy of a step newer than any in this rank's own fast folder; True where
        any rank took one (the same answer on every rank)."""
        held = self._newest(self.store.join(self.dirpath, f"{PEER_PREFIX}{self.source}"))
        reports = self._gather({"own": self._newest(self.dirpath), "held": held and held[0]})

        def needs(rank: int) -> bool:
            copy = reports[partners(rank, self.world_size, *self.layout)[0]]["held"]
            return copy is not None and (reports[rank]["own"] is None or copy > reports[rank]["own"])

        outgoing = [held[1]] if held and needs(self.source) else []
        self._exchange(to=self.source, frm=self.partner, outgoing=outgoing, folder=self.dirpath)
        return any(needs(rank) for rank in range(self.world_size))

    def _newest(self, folder: str) -> tuple[int, str] | None:
        """(step, path) of the newest committed checkpoint file in ``folder``, or None."""
        if not self.store.is_directory(folder):
            return None
        found = [(step, e.path) for e in _registry.committed(_registry.scan(folder, self.store,
                                                                              extension=self.extension))
                 if e.kind is _registry.Kind.FILE and (step := e.step) is not None]
        return max(found) if found else None

    # -- the wire ---------------------------------------------------------------------------------------------
    def _exchange(self, to: int, frm: int, outgoing: list[str], folder: str) -> None:
        """One symmetric step: ``outgoing`` (checkpoint files, each with its ``.data``) to ``to``, while the files
        ``frm`` sends are committed into ``folder``, every checksum verified (a damaged copy is removed)."""
        sending = [(p, [(f, os.path.getsize(f)) for f in (p, data_path(p)) if os.path.exists(f)]) for p in outgoing]
        header = {"files": [[os.path.basename(p), [size for _, size in parts]] for p, parts in sending]}
        incoming = self._swap(to, frm, header)["files"]
        chunks_out = _chunks([f for _, parts in sending for f, _ in parts])
        for name, sizes in incoming:
            target = self.store.join(folder, name)
            if folder != self.dirpath:
                os.makedirs(folder, exist_ok=True)
            with self.store.writing(target, with_data=len(sizes) > 1, required_bytes=sum(sizes)) as files:
                sinks: list[BinaryIO | None] = [files.main, files.data]
                for sink, size in zip(sinks, sizes):
                    for piece in _pieces(size):
                        self._both(next(chunks_out, None), to, piece, frm)
                        assert sink is not None
                        sink.write(memoryview(piece.numpy()))
            self._check(target)
        for chunk in chunks_out:  # what is left of ours to send, once theirs has come
            self._both(chunk, to, None, frm)
        if folder != self.dirpath and incoming:
            self._rotate(folder)

    def _check(self, target: str) -> None:
        try:
            with open_checkpoint(target) as reader:
                reader.verify()
        except CorruptCheckpointError:
            self.store.remove(target)
            raise

    def _rotate(self, folder: str) -> None:
        """A peer folder keeps the newest ``keep`` copies, as the fast tier does."""
        found = sorted(((e.step if e.step is not None else -1, e.path) for e in _registry.committed(
            _registry.scan(folder, self.store, extension=self.extension))), reverse=True)
        for _, path in found[self.keep:]:
            self.store.remove(path)

    def _swap(self, to: int, frm: int, header: dict[str, Any]) -> dict[str, Any]:
        import torch

        mine = json.dumps(header).encode()
        length = torch.zeros(1, dtype=torch.int64)
        self._both(torch.tensor([len(mine)], dtype=torch.int64), to, length, frm)
        theirs = torch.empty(int(length.item()), dtype=torch.uint8)
        self._both(torch.frombuffer(bytearray(mine), dtype=torch.uint8), to, theirs, frm)
        return dict(json.loads(theirs.numpy().tobytes()))

    def _gather(self, report: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``report``, in rank order (JSON over the group: one all-gather of sizes, one of bytes)."""
        import torch
        import torch.distributed as dist

        mine = json.dumps(report).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(mine)], dtype=torch.int64), group=self.group)
        width = max(int(s.item()) for s in sizes)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        every = [torch.empty(width, dtype=torch.uint8) for _ in sizes]
        dist.all_gather(every, padded, group=self.group)
        return [json.loads(t[:int(s.item())].numpy().tobytes()) for t, s in zip(every, sizes)]

    def _both(self, out: Any, to: int, into: Any, frm: int) -> None:
        """Send ``out`` to ``to`` while ``into`` is received from ``frm`` (either may be None)."""
        import torch.distributed as dist

        pending = ([dist.isend(out, to, group=self.group)] if out is not None else []) + \
            ([dist.irecv(into, frm, group=self.group)] if into is not None else [])
        for request in pending:
            if request is not None:
                request.wait()


def _pieces(size: int) -> Iterator[Any]:
    """Empty tensors to receive ``size`` bytes into, a chunk at a time."""
    import torch

    for start in range(0, size, _CHUNK):
        yield torch.empty(min(_CHUNK, size - start), dtype=torch.uint8)


def _chunks(paths: list[str]) -> Iterator[Any]:
    """The bytes of ``paths``, one after the other, a chunk at a time (the pieces the receiver expects)."""
    import torch

    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                yield torch.frombuffer(bytearray(chunk), dtype=torch.uint8)

