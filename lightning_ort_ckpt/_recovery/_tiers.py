"""Checkpoint tiers, as Orbax's emergency ``CheckpointManager`` has them: a fast node-local tier beside ``dirpath``.

``OrtCheckpoint(dirpath=..., local=LocalTier("/dev/shm/run", every_n_train_steps=1, keep=2))`` saves the whole
state every K steps into a node-local folder (RAM or local NVMe) besides the persistent saves of ``dirpath`` (every
N steps, on metric, top k, "last"), and keeps the newest ``keep`` there. A fast-tier save is an ordinary save of the
plugin (``trainer.save_checkpoint``: same format, same atomic commit, same checksums, a sharded folder under a
sharded strategy, in the background with ``async_save=True``); retention is the pure rule of ``_retention``; the
folder is listed by ``_registry``. A SIGTERM (``SIGTERMException``) saves the current step there before the exit. A
persistent save on a step the fast tier is due at is written once, there, and copied to ``dirpath`` (``_promotion``).

``fit(ckpt_path="last")`` takes the newest step of any tier (:func:`nearest_first`): the registry's listings of
the fast tier, ``dirpath`` and the SLURM ``hpc_ckpt_N.ckpt`` files of the Trainer's ``default_root_dir``, merged
newest step first, the fast tier first among equal steps; ``_resume`` then reads them in that order until one
resumes, so a valid fast tier is the only one read, and a damaged or wiped one falls back to the next tier.
With ``peer=True`` each fast save is also copied to a partner rank's fast folder, and a wiped folder is filled again
from there at ``setup``, before "last" reads anything (``_peer``; under a sharded strategy, ``_peer_folders``).
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from .._dcp import _strategies
from .._lightning import _lightning_adapter
from .._restore import _registry
from ._peer import Peers
from ._peer_folders import FolderPeers
from .._policies._retention import Ledger
from ..errors import CheckpointConfigError, CheckpointWarning
from ..format._store import Store, local_path, store_for

_STEP_IN_NAME = re.compile(r"(?:^|[-_])step=(\d+)")  # ModelCheckpoint's "{step}" in a file name
_HPC_NAME = re.compile(r"^hpc_ckpt_\d+\.ckpt$")  # what Lightning saves on SLURM's requeue signal


@dataclass(frozen=True)
class LocalTier:
    """The fast tier of ``OrtCheckpoint(local=...)`` (Orbax's ``LocalCheckpointOptions``).

    Args:
        dirpath: a node-local folder (``/dev/shm/run``, a local NVMe disk), not ``OrtCheckpoint``'s ``dirpath``.
        every_n_train_steps: save there every this many optimizer steps (1: every step).
        keep: how many of its newest checkpoints it keeps (older ones are deleted once a newer one is durable).
        peer: also copy each save to a partner rank's fast folder (on another node where there is one), from where
            a rank whose folder was wiped takes it back (``_peer``; a sharded strategy's folders: ``_peer_folders``).
    """

    dirpath: str | os.PathLike[str]
    every_n_train_steps: int = 1
    keep: int = 2
    peer: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dirpath, (str, os.PathLike)):
            raise CheckpointConfigError(f"LocalTier.dirpath must be a local folder's path, got {self.dirpath!r}")
        if not store_for(local_path(self.dirpath)).local:
            raise CheckpointConfigError(f"LocalTier.dirpath must be a node-local folder, not a URL: "
                                        f"{os.fspath(self.dirpath)!r} (a remote store is OrtCheckpoint's dirpath)")
        for name in ("every_n_train_steps", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointConfigError(f"LocalTier.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.peer, bool):
            raise CheckpointConfigError(f"LocalTier.peer must be True or False, got {self.peer!r}")


class Promoter(Protocol):
    """The plugin, as a promotion asks it to write a save into the fast tier first (``_promotion``)."""

    def promote(self, source: Callable[[str], str | None] | None) -> None: ...


class Saver(Protocol):
    """The callback whose saves the fast tier goes along with."""

    save_weights_only: bool
    checkpoint_io: Any  # a Promoter

    def _confined(self, path: str) -> bool: ...


class NoTier:
    """Without ``local=``: nothing changes."""

    reads_remote_folders = True  # "last" reads a remote checkpoint folder's metadata for its step

    def setup(self, trainer: Any, stage: str, resuming: bool) -> None:
        pass

    def reads_last_at_setup(self, trainer: Any) -> bool:
        return False

    def close(self, wait: Callable[[], None]) -> None:
        pass

    def around_saves(self, trainer: Any, callback: Saver,
                     exception: BaseException | None = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def nearest_first(self, persistent: list[_registry.Entry], trainer: Any) -> list[_registry.Entry]:
        return persistent


def tier(local: LocalTier | None, extension: str, persistent: str | os.PathLike[str] | None) -> FastTier | NoTier:
    """The tier ``OrtCheckpoint(local=...)`` asks for."""
    if local is None:
        return NoTier()
    if not isinstance(local, LocalTier):
        raise CheckpointConfigError(f"local must be a LocalTier or None, got {type(local).__name__}")
    return FastTier(local, extension, persistent)


class FastTier:
    """One callback's fast tier: when it saves, which of its files go, and what it holds for "last"."""

    reads_remote_folders = False  # a persistent folder ranks by its name's step: no object of it read for "last"

    def __init__(self, options: LocalTier, extension: str, persistent: str | os.PathLike[str] | None) -> None:
        self.options = options
        self.dirpath = os.path.abspath(local_path(options.dirpath))
        if persistent is not None and store_for(local_path(persistent)).absolute(local_path(persistent)) \
                == self.dirpath:
            raise CheckpointConfigError(f"LocalTier.dirpath {self.dirpath!r} is OrtCheckpoint's dirpath: the fast "
                                        "tier needs a folder of its own")
        self.extension = extension
        self.store: Store = store_for(self.dirpath)
        self.ledger = Ledger(options.keep)
        self.saved_step: int | None = None  # the step of its newest save in this fit
        self.peers: Peers | None = None  # this fit's exchanges of peer copies (``peer=True``, several ranks)

    def setup(self, trainer: Any, stage: str, resuming: bool) -> None:
        """A new fit: the folder made (on every node); where it resumes from "last" (``resuming``), a wiped one
        filled from the partner's peer copy; and on rank 0 the checkpoints there handed to retention, oldest step
        first, so that this fit's saves rotate them out."""
        if stage != "fit":
            return
        os.makedirs(self.dirpath, exist_ok=True)
        self.ledger, self.saved_step = Ledger(self.options.keep), None
        if self.reads_last_at_setup(trainer):
            kind = FolderPeers if _strategies.kind(trainer.strategy) == "sharded" else Peers  # a folder, or a file
            self.peers = kind(self.dirpath, self.store, self.options.keep, self.extension, trainer)
            if resuming:  # (every rank alike: the same fit call)
                self.peers.restore()
        elif self.options.peer and trainer.is_global_zero:
            warnings.warn("LocalTier(peer=True) with one process: there is no partner rank to copy to; the fast "
                          "tier saves as without it", CheckpointWarning, stacklevel=2)
        if trainer.is_global_zero:
            entries = self.entries()
            for entry in sorted(_registry.committed(entries), key=lambda e: (e.step is not None, e.step or 0)):
                self.ledger.saving(entry.path)
            self.ledger.waiting.update(e.path for e in _registry.half(entries))

    def reads_last_at_setup(self, trainer: Any) -> bool:
        """With peer copies, a rank's newest step may be on its partner until ``setup`` takes it back: "last" is
        read then (Lightning asks before the process group is up), not before."""
        return self.options.peer and trainer.world_size > 1

    def close(self, wait: Callable[[], None]) -> None:
        """The end of the fit: once ``wait`` (the plugin's) has run every queued exchange, the peers' group let go
        of, also where ``wait`` raises."""
        if self.peers is not None:
            peers, self.peers = self.peers, None
            try:
                wait()
            finally:
                peers.close()

    def entries(self) -> list[_registry.Entry]:
        return _registry.scan(self.dirpath, self.store, extension=self.extension)

    def due(self, trainer: Any, exception: BaseException | None = None) -> bool:
        """Whether the fast tier saves the step training just finished: every K steps, and at a SIGTERM (Lightning's
        ``SIGTERMException``, raised at a batch boundary, in a fit) whatever the step; other exceptions save nothing
        here (the state they leave is not one to resume from by default). Never twice a step."""
        step = trainer.global_step
        if exception is not None:
            scheduled = type(exception).__name__ == "SIGTERMException" and \
                getattr(trainer.state.fn, "value", None) == "fit"
        else:
            scheduled = step % self.options.every_n_train_steps == 0
        return (scheduled and step > 0 and step != self.saved_step and not trainer.sanity_checking
                and not trainer.fast_dev_run)

    @contextlib.contextmanager
    def around_saves(self, trainer: Any, callback: Saver, exception: BaseException | None = None) -> Iterator[None]:
        """Around ``ModelCheckpoint``'s saves at a batch's end (with ``exception``: at an exception), where the fast
        tier is due: the first save into ``dirpath`` is written here and copied there (promoted, ``_promotion``),
        and is this step's fast-tier save; where there was none, the fast tier saves the step after them (the whole
        state, whatever ``save_weights_only`` says of ``dirpath``). A weights-only save is not promoted (the fast
        tier holds whole states), nor a sharded strategy's (``_strategies``: folders)."""
        if not self.due(trainer, exception):
            yield
            return
        step, before = trainer.global_step, _lightning_adapter.last_step_saved(callback)
        path = self.store.join(self.dirpath, f"step={step}{self.extension}")
        taken: list[str] = []

        def source(target: str) -> str | None:  # asked by the plugin of the rank that writes (rank 0)
            if taken or not callback._confined(target):
                return None
            taken.append(target)
            return path

        promoting = not callback.save_weights_only and _strategies.kind(trainer.strategy) is None
        if promoting:
            callback.checkpoint_io.promote(source)
        try:
            yield
        finally:
            if promoting:
                callback.checkpoint_io.promote(None)
        self.ledger.saving(path)
        # decided alike on every rank (a save is a collective): did ModelCheckpoint save into dirpath just now?
        if not (promoting and _lightning_adapter.last_step_saved(callback) == step != before):
            trainer.save_checkpoint(path, weights_only=False)
        self.saved_step = trainer.global_step
        if self.peers is not None:  # once the save is committed (where the plugin's saves run), to the peers' thread
            callback.checkpoint_io.run_in_order(self.peers.hand_off, path, trainer.is_global_zero)
        for old in self.ledger.release(()):  # deleted after the new file is durable (the plugin runs both in order)
            trainer.strategy.remove_checkpoint(old)

    def nearest_first(self, persistent: list[_registry.Entry], trainer: Any) -> list[_registry.Entry]:
        """"last"'s candidates in every tier (module doc)."""
        return nearest_first([self.entries(), persistent, hpc_entries(trainer, self.extension)])


def hpc_entries(trainer: Any, extension: str) -> list[_registry.Entry]:
    """The ``hpc_ckpt_N.ckpt`` files Lightning saved on SLURM's requeue signal in the Trainer's ``default_root_dir``
    (where it saves and looks for them)."""
    root = str(trainer.default_root_dir)
    store = store_for(root)
    if not store.local:  # (Lightning's own hpc resume reads a remote one; "last" lists local folders only)
        return []
    return [e for e in _registry.scan(store.absolute(root), store, extension=extension)
            if _HPC_NAME.match(os.path.basename(e.path))]


def step_of(entry: _registry.Entry) -> int | None:
    """The step ``entry`` records, or the one its name says (``step=N``: a remote file's step is not known without
    downloading it); None where neither says."""
    if entry.step is not None:
        return entry.step
    found = _STEP_IN_NAME.search(os.path.basename(entry.path))
    return int(found.group(1)) if found else None


def nearest_first(tiers: list[list[_registry.Entry]]) -> list[_registry.Entry]:
    """The committed checkpoints of ``tiers`` (nearest tier first) newest step first, the nearer tier first among
    equal steps; those whose step is unknown after them, in their tier's order; then the rest of the listings (half
    written, foreign), for what reports them. A path listed by two tiers is taken once."""
    seen: set[str] = set()
    ranked: list[tuple[int, int, int, _registry.Entry]] = []
    rest: list[_registry.Entry] = []
    for tier, entries in enumerate(tiers):
        for entry in entries:
            if entry.path in seen:
                continue
            seen.add(entry.path)
            if entry.state is not _registry.State.COMMITTED:
                rest.append(entry)
                continue
            step = step_of(entry)
            ranked.append((-1 if step is None else step, -tier, -len(ranked), entry))
    return [r[3] for r in sorted(ranked, key=lambda r: r[:3], reverse=True)] + rest
