"""Peer copies of the fast tier (``LocalTier(peer=True)``; Gemini's copies in a partner's memory, here on its disk).

A node replaced after a failure comes back with an empty fast folder. With peer copies, each fast-tier save is also
sent to a partner rank, on another node where there is one (``node_rank`` apart: rank ``r`` sends to
``(r + devices) % world_size``; on one node, to the next rank), over a gloo process group of its own (made at the
fast tier's ``setup``, destroyed at the end of the fit), and the partner commits it in its fast folder under
``peer-of-rank<r>/``, with the store's atomic commit, every checksum verified, keeping as many as the fast tier keeps.
The plugin's executor hands each save's exchange, once the save is committed, to a thread of the fast tier's own, so
that saves never wait for copies; the exchange is one symmetric step (every rank sends its file of the step, maybe
none, to its partner and receives its own peer's), taken by every rank in the same order of steps, so it cannot
deadlock; the group's timeout bounds a rank that never comes. A copy that falls behind by more than ``keep`` saves
finds the file rotated out and sends nothing: the cost stays bounded, and the newest steps are copied.

At ``setup``, before "last" is read: every rank says (one all-gather) the newest step in its fast folder and the
newest peer copy it holds; a rank whose partner holds a newer step than its own folder gets it back over the group
and commits it into its fast folder (:meth:`Peers.restore`), so that "last" then finds it there: nothing of the
persistent tier is read. Only full-state saves (one file, written by global rank 0: DDP, one device) are copied in
this version; the sharded strategies' folders are not.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, BinaryIO

from .._restore import _registry
from .._saving._async_saver import BackgroundQueue
from ..errors import CorruptCheckpointError
from ..format import data_path, open_checkpoint
from ..format._store import Store

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
        self.queue = BackgroundQueue()  # the exchanges, in the order of the saves

    def close(self) -> None:
        """Run the exchanges handed over (the caller waited for the plugin's queue first), stop the thread, let go
        of the group; then raise the first error of an exchange."""
        import torch.distributed as dist

        self.queue.close()
        dist.destroy_process_group(self.group)
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
        mine = [path] if writes else []
        self._exchange(to=self.partner, frm=self.source, outgoing=mine,
                       folder=self.store.join(self.dirpath, f"{PEER_PREFIX}{self.source}"))

    # -- at setup ---------------------------------------------------------------------------------------------
    def restore(self) -> None:
        """Take back from the partner the copy of a step newer than any in this rank's own fast folder (every rank
        alike: one all-gather of what each holds, then one exchange)."""
        own = self._newest(self.dirpath)
        held = self._newest(self.store.join(self.dirpath, f"{PEER_PREFIX}{self.source}"))
        reports = self._gather({"own": own and own[0], "held": held and held[0]})

        def needs(rank: int) -> bool:
            copy = reports[partners(rank, self.world_size, *self.layout)[0]]["held"]
            return copy is not None and (reports[rank]["own"] is None or copy > reports[rank]["own"])

        outgoing = [held[1]] if held and needs(self.source) else []
        self._exchange(to=self.source, frm=self.partner, outgoing=outgoing, folder=self.dirpath)

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
        with contextlib.ExitStack() as opened:
            sending = [(os.path.basename(p), files) for p in outgoing if (files := opened_pair(p, opened))]
            header = {"files": [[name, [os.fstat(f.fileno()).st_size for f in files]] for name, files in sending]}
            incoming = self._swap(to, frm, header)["files"]
            self._stream(_chunks([f for _, files in sending for f in files]), incoming, to, frm, folder)

    def _stream(self, chunks_out: Iterator[Any], incoming: list[Any], to: int, frm: int, folder: str) -> None:
        """Our chunks out while the files ``incoming`` names come in, each committed into ``folder``."""
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


def opened_pair(path: str, stack: contextlib.ExitStack) -> list[BinaryIO]:
    """The checkpoint ``path`` and its ``.data`` where it has one, open (a rotation deleting them now cannot take
    bytes the partner was told of); none where the checkpoint is gone already."""
    files: list[BinaryIO] = []
    for name in (path, data_path(path)):
        try:
            files.append(stack.enter_context(open(name, "rb")))
        except FileNotFoundError:
            if name == path:
                return []
            break
    return files


def _chunks(files: list[BinaryIO]) -> Iterator[Any]:
    """The bytes of ``files``, one after the other, a chunk at a time (the pieces the receiver expects)."""
    import torch

    for f in files:
        while chunk := f.read(_CHUNK):
            yield torch.frombuffer(bytearray(chunk), dtype=torch.uint8)

