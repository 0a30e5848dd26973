"""Peer copies of a sharded fast tier (``LocalTier(peer=True)`` under ModelParallel, FSDP with sharded state).

A sharded fast-tier save is one unit spread over the nodes: every rank writes its shard files into its own node's
fast folder (``step=N.ckpt/``), and global rank 0 commits the metadata, which names every shard file, into its
own. No node's folder alone can be loaded: every rank's load reads the metadata and whatever it needs of any
rank's files (tensors saved once, such as every rank's random states). So:

- after each save (on the fast tier's thread, as ``_peer``'s exchanges), every rank sends its shard files of the
  step, and rank 0 the metadata after them, to its partner, which commits them in ``peer-of-rank<r>/step=N.ckpt/``
  (every checksum verified; the metadata checked whole);
- at ``setup``, before "last" is read, every rank reports (one all-gather) the steps its own folder and its peer
  folders hold, file by file; the newest step whose files (all that its metadata names) are held somewhere is
  assembled whole in every fast folder by its keeper (``_peer``: the lowest rank of the node's folder): each
  missing file copied from a peer folder in it where it holds it, else sent over the group by a rank that does, the
  metadata last (the folder's commit). Every rank's "last" then finds the same whole folder on its own node: nothing
  of the persistent tier is read. A committed folder of a newer step that no rank can make whole (a partner's
  shards lost with its node before they were copied) is removed by its keeper: it cannot be loaded, and would split
  the ranks' choice of "last".

Global rank 0's own folder rotates with the fast tier's retention (``_tiers``); the other folders' keepers rotate
theirs, and every rank its peer folders, after each exchange, keeping ``keep`` steps.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

from ._peer import PEER_PREFIX, Peers, plan
from .._dcp._dcp_folder import METADATA_NAME, read_metadata
from ..errors import CheckpointError

_STEP_FOLDER = re.compile(r"^step=(\d+)")  # the fast tier's folders: "step=N<extension>"


class FolderPeers(Peers):
    """One sharded fast tier's exchanges: the files of its step folders, for one fit (the wire is ``Peers``')."""

    def replicate(self, path: str, writes: bool) -> None:
        """This rank's files of the committed folder ``path`` to the partner, the source's committed here."""
        name = os.path.basename(path)
        mine = [(f"{name}/{f}", os.path.join(path, f)) for f in self._own_files(path)]
        peer_folder = self.store.join(self.dirpath, f"{PEER_PREFIX}{self.source}")
        self.wire.exchange(to=self.partner, frm=self.source, outgoing=mine, folder=peer_folder)
        step = _step(name)
        if step is not None:
            self._rotate_steps(peer_folder, step)
            if self.rank == self.keeper != 0:  # rank 0's own folder rotates with the fast tier's ledger
                self._rotate_steps(self.dirpath, step)

    def _own_files(self, path: str) -> list[str]:
        """The shard files this rank wrote into ``path`` (their ``.data`` travel with them), then, on rank 0, the
        metadata it committed (the other ranks of its node see it there too)."""
        try:
            names = os.listdir(path)
        except FileNotFoundError:  # rotated out before its copy: nothing to send
            return []
        shards = sorted(n for n in names if n.endswith(f"-{self.rank:05d}.odtc"))
        return shards + ([METADATA_NAME] if self.rank == 0 and METADATA_NAME in names else [])

    # -- at setup ---------------------------------------------------------------------------------------------
    def restore(self) -> None:
        """The newest step held whole among every rank's folders, assembled in every fast folder by its keeper;
        every folder done when it returns (module doc)."""
        reports = self.wire.gather(self._folders())
        chosen = _newest_whole(reports)
        if self.rank == self.keeper:
            self._drop_unmakeable(reports[self.rank], chosen)
        if chosen is not None:
            step, files = chosen
            name = next(r["names"][str(step)] for r in reports if str(step) in r["names"])
            for batch in (files, [METADATA_NAME]):  # shards first, then the metadata: the folder's commit
                for src, dst, where in plan([r["held"] for r in reports], str(step), name, batch, self.keepers):
                    self.transfer(src, dst, where, f"{name}/{os.path.basename(where)}")
        self.wire.barrier()  # a rank that is no keeper reads its folder once its keeper has made it whole

    def _folders(self) -> dict[str, Any]:
        """What this rank holds: {"held": {"" (its own folder) or a peer folder: {step: its folder's files}},
        "names": {step: the folder's name}, "needs": {step: the shard files its metadata names, where it has one}}."""
        report: dict[str, Any] = {"held": {}, "names": {}, "needs": {}}
        places = [""] + sorted(p for p in os.listdir(self.dirpath) if p.startswith(PEER_PREFIX))
        for place in places:
            folder = os.path.join(self.dirpath, place) if place else self.dirpath
            report["held"][place] = {}
            for sub in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
                step, path = _step(sub), os.path.join(folder, sub)
                if step is None or not sub.endswith(self.extension) or not os.path.isdir(path):
                    continue
                names = sorted(os.listdir(path))
                report["held"][place][str(step)], report["names"][str(step)] = names, sub
                if METADATA_NAME in names and str(step) not in report["needs"]:
                    with contextlib.suppress(CheckpointError, OSError):
                        report["needs"][str(step)] = sorted(read_metadata(path, self.store)["files"])
        return report

    def _drop_unmakeable(self, mine: dict[str, Any], chosen: tuple[int, list[str]] | None) -> None:
        """This rank's committed folders newer than the chosen step: no rank can make them whole."""
        newest = chosen[0] if chosen is not None else -1
        for step, names in mine["held"][""].items():
            if int(step) > newest and METADATA_NAME in names:
                self.store.remove(self.store.join(self.dirpath, mine["names"][step]))

    def _rotate_steps(self, folder: str, upto: int) -> None:
        """Best effort: of ``folder``'s step folders up to step ``upto``, the newest ``keep`` stay (a newer one is
        being written)."""
        with contextlib.suppress(OSError, CheckpointError):
            found = sorted(((s, n) for n in os.listdir(folder) if (s := _step(n)) is not None and s <= upto
                            and os.path.isdir(os.path.join(folder, n))), reverse=True)
            for _, old in found[self.keep:]:
                with contextlib.suppress(OSError, CheckpointError):
                    self.store.remove(self.store.join(folder, old))


def _step(name: str) -> int | None:
    found = _STEP_FOLDER.match(name)
    return int(found.group(1)) if found else None


def _newest_whole(reports: list[dict[str, Any]]) -> tuple[int, list[str]] | None:
    """(step, its shard files) of the newest step whose metadata and every shard file it names some rank holds."""
    for step in sorted({int(s) for r in reports for s in r["needs"]}, reverse=True):
        files = next(r["needs"][str(step)] for r in reports if str(step) in r["needs"])
        if all(any(f in names.get(str(step), []) for r in reports for names in r["held"].values())
               for f in (*files, METADATA_NAME)):
            return step, files
    return None
