"""Rank agreement at ``setup``: every rank sees one ``dirpath``, and every rank resumes from what rank 0 resolved.

Rank 0 writes a marker file named by a random token in ``dirpath`` when fitting; every rank must find it (by its name:
a HEAD on a store, no object of ``dirpath`` read). Rank 0's ``ckpt_path="last"`` choice is broadcast with it, and
each rank says whether it can follow it (``adopt``). Every rank calls the same two collectives (one broadcast, one
all-gather), whatever it finds, and every rank raises the same error: a rank that raised alone would leave the others
waiting in the next collective until the process group times out.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from typing import Any

from ._resume import LastChoice
from ..errors import CheckpointConfigError, CheckpointError, CheckpointSaveError
from ..format._store import Store

MARKER_PREFIX = ".ort_ckpt.shared."  # the file rank 0 writes in dirpath at setup, for every rank to find


def problem_with(dirpath: str | None, store: Store) -> str | None:
    """Why ``dirpath`` cannot hold checkpoints (it is a file), or None. A folder's contents are not read (on a
    store, a folder is a listing: a valid fast tier reads no object of the persistent one, ``_tiers``)."""
    if dirpath is not None and not store.is_directory(dirpath) and store.read_head(dirpath, 1):
        return f"dirpath {dirpath!r} is a file, not a directory"
    return None


def agree(trainer: Any, dirpath: str | None, store: Store, writing: bool, mine: LastChoice | None,
          adopt: Callable[[LastChoice | None], bool]) -> LastChoice | None:
    """Check, on every rank together, that ``dirpath`` is one directory for all ranks (``writing``: a fit, where
    rank 0 writes its marker) and that each rank can resume from rank 0's "last" choice; returns rank 0's choice.
    Raises :class:`CheckpointConfigError` on every rank, or on none."""
    problem = problem_with(dirpath, store)
    if trainer.world_size == 1:
        if problem is not None:
            raise CheckpointConfigError(problem)
        return mine
    import torch  # loaded with Lightning by now

    strategy = trainer.strategy
    marker = token = None
    if trainer.is_global_zero and problem is None and writing and dirpath is not None:
        token = secrets.token_hex(16)
        marker = store.join(dirpath, f"{MARKER_PREFIX}{token}")
        try:
            with store.writing(marker, with_data=False, required_bytes=len(token)) as files:
                files.main.write(token.encode())
        except (CheckpointError, OSError) as e:
            problem, marker = f"rank 0 cannot write in dirpath {dirpath!r} ({e})", None
    marker, token, problem, last = strategy.broadcast((marker, token, problem, mine), src=0)
    seen = marker is None or store.exists(marker)  # its name is the random token: no object of dirpath is read
    agrees = adopt(last)
    flags = strategy.all_gather(torch.tensor([int(seen), int(agrees), trainer.node_rank],
                                             device=strategy.root_device)).reshape(-1, 3).tolist()
    if marker is not None and trainer.is_global_zero:
        with contextlib.suppress(CheckpointError, OSError):
            store.remove(marker)
    blind = [(rank, node) for rank, (s, _, node) in enumerate(flags) if not s]
    astray = [rank for rank, (_, a, _) in enumerate(flags) if not a]
    if problem is not None:
        raise CheckpointConfigError(problem)
    if blind:
        ranks = ", ".join(f"{rank} (node {node})" for rank, node in blind)
        raise CheckpointConfigError(
            f"dirpath {dirpath!r} is not one directory for all ranks: global rank(s) {ranks} do not see the file "
            "global rank 0 wrote there. Rank 0 alone writes the checkpoints, and every rank reads them to resume: "
            "with num_nodes > 1, dirpath must be a directory every node shares (a network file system, or a URL "
            "such as s3://... with storage_options), not a node-local disk")
    if astray:
        this = "" if trainer.global_rank not in astray else f" (this rank: {(mine and mine.path) or 'none'})"
        raise CheckpointConfigError(
            f'ckpt_path="last": global rank 0 resolved it to {(last and last.path) or "no checkpoint"} in '
            f"dirpath {dirpath!r}, but global rank(s) {', '.join(map(str, astray))} found another{this} and "
            "cannot load rank 0's: is dirpath a directory every node shares?")
    return last


def all_ranks(trainer: Any) -> Callable[[bool], bool]:
    """One collective: True where every rank says True (F2's agreement on a load)."""
    return lambda ok: bool(trainer.strategy.reduce_boolean_decision(ok, all=True))


def attempt(link: Callable[[], None], filepath: str, linkpath: str) -> Exception | None:
    """Rank 0 links ``linkpath`` to ``filepath``; the error it met, or None."""
    try:
        link()
    except CheckpointError as e:
        return e
    except OSError as e:
        return CheckpointSaveError(f"cannot link it to {filepath!r} ({e.strerror or e})", linkpath)
    return None


def raise_together(trainer: Any, error: Exception | None, filepath: str, linkpath: str) -> None:
    """ModelCheckpoint's barrier after a link, carrying whether it was made: every rank raises, or none (one that
    raised alone would leave the others waiting in the next collective)."""
    if not trainer.strategy.reduce_boolean_decision(error is None, all=True) and error is None:
        error = CheckpointSaveError(f"global rank 0 could not link it to {filepath!r} (its error says why)", linkpath)
    if error is not None:
        raise error
