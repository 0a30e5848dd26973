"""The wire of the fast tier's peer copies (``_peer``): a gloo group of its own, and checkpoint files sent over it.

Every transfer is one symmetric step between two ranks (each sends its files, maybe none, and commits the ones it
receives), so two ranks that take their steps in the same order cannot deadlock; the group's timeout bounds a rank
that never comes. A received file is committed with the store's atomic commit and checked before it counts: every
checksum of a checkpoint file, the whole document of a sharded folder's metadata (a damaged copy is removed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, BinaryIO

from .._dcp._dcp_folder import METADATA_NAME, read_metadata
from ..errors import CheckpointError
from ..format import data_path, open_checkpoint
from ..format._store import Store

TIMEOUT = timedelta(minutes=3)  # a partner that never takes part in an exchange: the exchange fails after this
_CHUNK = 16 << 20  # bytes sent at a time


class Wire:
    """A gloo group of its own over every rank, for one fit; files and reports sent over it."""

    def __init__(self, store: Store, world_size: int) -> None:
        import torch.distributed as dist  # the process group is up by setup

        self.store, self.world_size = store, world_size
        self.group: Any = dist.new_group(backend="gloo", timeout=TIMEOUT)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group(self.group)

    def exchange(self, to: int, frm: int, outgoing: list[tuple[str, str]], folder: str) -> list[str]:
        """One symmetric step: ``outgoing`` (name to give it, path of a checkpoint file: each with its ``.data``)
        to ``to``, while the files ``frm`` sends are committed into ``folder`` under the names it gives, every one
        checked; returns their paths. A file gone by now (rotated out) is not sent."""
        with contextlib.ExitStack() as opened:
            sending = [(name, files) for name, p in outgoing if (files := opened_pair(p, opened))]
            header = {"files": [[name, [os.fstat(f.fileno()).st_size for f in files]] for name, files in sending]}
            incoming = self._swap(to, frm, header)["files"]
            return self._stream(_chunks([f for _, files in sending for f in files]), incoming, to, frm, folder)

    def _stream(self, chunks_out: Iterator[Any], incoming: list[Any], to: int, frm: int, folder: str) -> list[str]:
        """Our chunks out while the files ``incoming`` names come in, each committed into ``folder``."""
        received = []
        for name, sizes in incoming:
            target = self.store.join(folder, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with self.store.writing(target, with_data=len(sizes) > 1, required_bytes=sum(sizes)) as files:
                sinks: list[BinaryIO | None] = [files.main, files.data]
                for sink, size in zip(sinks, sizes):
                    for piece in _pieces(size):
                        self._both(next(chunks_out, None), to, piece, frm)
                        assert sink is not None
                        sink.write(memoryview(piece.numpy()))
            self._check(target)
            received.append(target)
        for chunk in chunks_out:  # what is left of ours to send, once theirs has come
            self._both(chunk, to, None, frm)
        return received

    def copy(self, source: str, target: str) -> None:
        """The checkpoint file ``source`` (with its ``.data``) committed as ``target`` on this node, checked."""
        with contextlib.ExitStack() as opened:
            files = opened_pair(source, opened)
            sizes = [os.fstat(f.fileno()).st_size for f in files]
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with self.store.writing(target, with_data=len(files) > 1, required_bytes=sum(sizes)) as out:
                for f, sink in zip(files, (out.main, out.data)):
                    assert sink is not None
                    shutil.copyfileobj(f, sink, _CHUNK)
        self._check(target)

    def _check(self, target: str) -> None:
        try:
            if os.path.basename(target) == METADATA_NAME:  # a sharded folder's metadata, its commit
                read_metadata(os.path.dirname(target), self.store)
            else:
                with open_checkpoint(target) as reader:
                    reader.verify()
        except CheckpointError:
            self.store.remove(target)
            raise

    def _swap(self, to: int, frm: int, header: dict[str, Any]) -> dict[str, Any]:
        import torch

        mine = json.dumps(header).encode()
        length = torch.zeros(1, dtype=torch.int64)
        self._both(torch.tensor([len(mine)], dtype=torch.int64), to, length, frm)
        theirs = torch.empty(int(length.item()), dtype=torch.uint8)
        self._both(torch.frombuffer(bytearray(mine), dtype=torch.uint8), to, theirs, frm)
        return dict(json.loads(theirs.numpy().tobytes()))

    def gather(self, report: Any) -> list[Any]:
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

    def barrier(self) -> None:
        """Every rank here, waiting as long as a job's collectives wait by default (torch's 30 minutes): for the
        slowest rank's whole restore, which ``TIMEOUT`` (one transfer's chunk) does not bound."""
        import torch.distributed as dist

        dist.monitored_barrier(group=self.group, timeout=dist.default_pg_timeout)

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
