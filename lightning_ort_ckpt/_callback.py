"""``OrtCheckpoint``: Lightning's ``ModelCheckpoint``, writing ORT checkpoints, with the fixes its users ask for.

It takes every ``ModelCheckpoint`` argument with the same meaning (it *is* a ``ModelCheckpoint``, so
``ckpt_path="last"`` and ``"best"`` resolve to its files) and installs :class:`OrtCheckpointIO` by itself. As Orbax's
``CheckpointManager``, it delegates: when a save is ranked (``_save_decision``), which files go (``_retention``),
what a directory holds (``_registry``), which checkpoint "last" is and the fallback when it cannot load
(``_resume``), the ranks' agreement (``_ranks``), the export when fit ends (``_export_callback``, added by
``export_best_to=``). On top of ``ModelCheckpoint`` (docs/callback.md says more):

- **Triggers combine** (``every_n_train_steps``, ``every_n_epochs``, ``train_time_interval``; with ``monitor``,
  every fresh value is a trigger too), and **no stale ranking**: a save is ranked by the monitored value only if
  that value was computed at the step being saved; otherwise it is written unranked, or waits for the value when
  validation computes it right after this batch. Every file records the step its value comes from
  (``current_score_step``).
- **Keep the newest N** (``keep_newest``) next to the top k; nothing protected (top k, best, last, the target of a
  last link, a file the user resumed from) is ever deleted, nothing before the new file is durable, and nothing but
  a checkpoint inside ``dirpath``.
- **Remote ``dirpath``** (any fsspec URL, with ``storage_options``): files and checkpoint folders are listed,
  resumed and deleted on the store; ``save_last="link"`` becomes a copy there. A ``file://`` URL is the local path.
- **"last" falls back** to the newest checkpoint that can resume a fit (files and sharded folders, local and
  remote; a sharded folder that fails to load on any rank makes every rank fall back together); where none can,
  it is an error listing each, unless ``resume_fallback="scratch"``.
- **Several ranks and nodes**: every rank must see ``dirpath`` and resume from rank 0's choice (``_ranks``).
- **Exact resume from any save point**: the random states are applied again at ``on_train_start``.
- ``include_optimizer_state=False`` is ``save_weights_only=True`` under ORT's name; ``verbose=True`` logs each save
  (what, where, why) and the export.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pytorch_lightning.callbacks import ModelCheckpoint

from ._lightning import _lightning_adapter, _loggers
from ._restore import _ranks, _registry, _resume
from ._binding import bound_plugin
from ._lightning._namespaces import loaded, namespace_of
from ._plugin import OrtCheckpointIO, OrtCheckpointIOMixin
from ._restore._resume import ResumeFallback
from ._policies._preservation import Preservation
from ._policies._save_decision import SaveDecision, Verdict
from ._recovery._tiers import LocalTier, tier
from .errors import CheckpointConfigError, CheckpointError, CheckpointWarning
from .format._store import StorageOptions, Store, local_path, wait_for_cleanup
from .format._writer import ExternalData

if TYPE_CHECKING:  # type checkers see ModelCheckpoint's methods; at run time the concrete classes add its copy
    _Base = ModelCheckpoint
else:
    _Base = object

Exporter = Callable[[Any, "str | os.PathLike[str]", float, "OrtCheckpointMixin"], Any]
_EXPORTER: list[Exporter] = []  # the export callback's factory (layer 4 hands it over: see _export_callback)


def use_exporter(factory: Exporter) -> None:
    """What ``export_best_to=`` adds to the Trainer: ``factory(trainer, to, tolerance, callback)``."""
    _EXPORTER[:] = [factory]


class Hook(Enum):
    """The hook a save happens in: the trigger a verbose line names."""

    OTHER = "the end of training, or an exception"
    BATCH_END = "training batch end"
    EPOCH_END = "training epoch end"
    VALIDATION_END = "validation end"


class OrtCheckpointMixin(_Base):
    """The behaviour of ``OrtCheckpoint``, shared by the ``pytorch_lightning`` and ``lightning.pytorch`` classes."""

    plugin_class: ClassVar[type[OrtCheckpointIOMixin]] = OrtCheckpointIO
    """The ``OrtCheckpointIO`` class of this callback's copy of Lightning."""

    def __init__(self, dirpath: str | os.PathLike[str] | None = None, filename: str | None = None,
                 monitor: str | None = None, verbose: bool = False, save_last: bool | Literal["link"] | None = None,
                 save_top_k: int = 1, save_on_exception: bool = False, save_weights_only: bool = False,
                 mode: str = "min", auto_insert_metric_name: bool = True, every_n_train_steps: int | None = None,
                 train_time_interval: timedelta | None = None, every_n_epochs: int | None = None,
                 save_on_train_epoch_end: bool | None = None, enable_version_counter: bool = True, *,
                 include_optimizer_state: bool | None = None, keep_newest: int | None = None,
                 resume_fallback: ResumeFallback = "raise", checkpoint_io: OrtCheckpointIOMixin | None = None,
                 async_save: bool | None = None, external_data: ExternalData | None = None,
                 ort_compatible: bool | None = None, share_frozen: bool | Literal["trusted"] | None = None,
                 storage_options: StorageOptions | None = None, export_best_to: str | os.PathLike[str] | None = None,
                 export_tolerance: float = 1e-5, local: LocalTier | None = None) -> None:
        """Every argument before ``*`` is ``ModelCheckpoint``'s, with its meaning (docs/callback.md lists where we
        differ on purpose); the ones after it are ours (docs/callback.md): ``include_optimizer_state`` (ORT's name
        for ``not save_weights_only``), ``keep_newest`` (keep the newest N files, ORT's ``max_num_checkpoints``),
        ``resume_fallback`` (``"scratch"``: ``ckpt_path="last"`` trains from scratch where no checkpoint of
        ``dirpath`` can be resumed, instead of raising), ``checkpoint_io`` or the five ``OrtCheckpointIO`` settings
        for the plugin built here, ``export_best_to``/``export_tolerance`` (``ExportBest``), ``local`` (``LocalTier``).

        Raises:
            CheckpointConfigError: an argument, or a combination of them, is invalid.
        """
        settings: dict[str, Any] = {k: v for k, v in (
            ("external_data", external_data), ("ort_compatible", ort_compatible), ("async_save", async_save),
            ("share_frozen", share_frozen), ("storage_options", storage_options)) if v is not None}
        triggers: dict[str, Any] = {k: v for k, v in (
            ("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs),
            ("train_time_interval", train_time_interval)) if v is not None}
        _check_arguments(self.plugin_class, dirpath, triggers, keep_newest, include_optimizer_state,
                         save_weights_only, checkpoint_io, settings, resume_fallback, export_best_to)
        if keep_newest is not None and monitor is None and save_top_k == 1:
            save_top_k = -1  # without a metric, keep_newest alone decides which files go
        super().__init__(dirpath=local_path(dirpath) if dirpath is not None else None, filename=filename,
                         monitor=monitor, verbose=verbose, save_last=save_last, save_top_k=save_top_k,
                         save_on_exception=save_on_exception, mode=mode,
                         save_weights_only=save_weights_only or include_optimizer_state is False,
                         auto_insert_metric_name=auto_insert_metric_name,
                         save_on_train_epoch_end=save_on_train_epoch_end, enable_version_counter=enable_version_counter,
                         **dict(list(triggers.items())[:1]))  # it takes one trigger: the others are set below
        if len(triggers) > 1:  # (each is checked on its own in ModelCheckpoint's hooks)
            _lightning_adapter.set_triggers(self, every_n_train_steps, every_n_epochs, train_time_interval)
        self.keep_newest, self.resume_fallback = keep_newest, resume_fallback
        self._own_io = checkpoint_io is not None or bool(settings)  # chosen here: the Trainer's may not replace it
        self.checkpoint_io: OrtCheckpointIOMixin = checkpoint_io or _own_plugin(self.plugin_class, settings)
        self.export_best_to, self.export_tolerance = export_best_to, export_tolerance
        self._exporter: Any = None
        self.current_score_step: int | None = None
        self._decision = SaveDecision(monitor)
        self._verdict = Verdict.PLAIN  # what the save in progress is (LAST inside _save_last_checkpoint)
        self._hook = Hook.OTHER
        self._resumption = _resume.Resumption(resume_fallback)
        self._preservation = Preservation(keep_newest, self._resumption, self.FILE_EXTENSION)
        self._tier = tier(local, self.FILE_EXTENSION, dirpath)  # (_tiers: nothing without local=)
        self._stand_in = _lightning_adapter.LastStandIn()  # what Lightning dates for "last" on a store

    # -- set-up -------------------------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _check_copy(self, trainer)
        if self.export_best_to is not None and self._exporter not in trainer.callbacks:
            self._exporter = _EXPORTER[0](trainer, self.export_best_to, self.export_tolerance, self)
            trainer.callbacks.append(self._exporter)  # after this one: it exports once the files are durable
        linking = self.save_last == "link" and not self._store().local  # ModelCheckpoint refuses links on a store;
        with _for_now(self, "save_last", True, "link") if linking else contextlib.nullcontext():  # ours are copies
            super().setup(trainer, pl_module, stage)
        self.checkpoint_io = _install_plugin(self, trainer)
        self.checkpoint_io.bind(trainer.strategy)
        if self.checkpoint_io.storage_options is not None and not self._store().local:
            _lightning_adapter.set_checkpoint_filesystem(self, str(self.dirpath), self.checkpoint_io.storage_options)
        resuming = self._resumption.choice is not None  # "last" was asked
        self._tier.setup(trainer, stage, resuming)  # first: a peer copy taken back there is "last"'s to find (_peer)
        if self._tier.reads_last_at_setup(trainer) and resuming:
            _resolve_again(self, trainer)
        _agree_on_last(self, trainer, stage)
        _loggers.check_loggers(trainer)

    @property
    def include_optimizer_state(self) -> bool:
        """ORT's name for ``not save_weights_only``."""
        return not self.save_weights_only

    @property
    def export_report(self) -> Any:
        """What ``export_best_to`` exported (``lightning_ort_ckpt.export.ExportReport``), once fit has ended."""
        return getattr(self._exporter, "report", None)

    def _store(self, path: str | None = None) -> Store:
        """The store of ``path`` (``dirpath`` by default): the plugin's, built once for its lifetime and shared by
        its saves, removals and links and this callback's listings and resumes (``format._store.Stores``)."""
        return self.checkpoint_io.stores.of(path if path is not None else self.dirpath)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """A file of a ModelCheckpoint with the same monitor, mode and triggers: carry on with its ranking, as
        ModelCheckpoint itself would (Lightning restores it next, by our key)."""
        states, twin = checkpoint.get("callbacks"), "ModelCheckpoint" + self.state_key[len(type(self).__qualname__):]
        if isinstance(states, dict) and self.state_key not in states and twin in states:
            states[self.state_key] = states[twin]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """The random states of the checkpoint resumed from, where the uninterrupted run had them."""
        self.checkpoint_io.restore_random_states(trainer)
        super().on_train_start(trainer, pl_module)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _forget_last(self)
        self._tier.close(self.checkpoint_io.wait)  # (the peer copies' exchanges run in the plugin's queue)
        self.checkpoint_io.wait()  # every file durable and every error raised before fit returns (and exports)
        wait_for_cleanup()  # what the tier deleted after the plugin's teardown (Lightning tears callbacks down last)
        _loggers.log_whole_units(trainer, self, finishing=True)  # what loggers log at finalize, after teardown
        super().teardown(trainer, pl_module, stage)

    # -- when to save, and ranked or not (_save_decision) --------------------------------------------------------
    def _in(self, hook: Hook, trainer: Any) -> contextlib.AbstractContextManager[None]:
        """Inside Lightning's ``hook``, with the monitored value as it is now."""
        self._decision.note(trainer.callback_metrics, trainer.global_step)
        return _for_now(self, "_hook", hook, Hook.OTHER)

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        with self._in(Hook.BATCH_END, trainer), self._tier.around_saves(trainer, self):
            super().on_train_batch_end(trainer, *args, **kwargs)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        with self._tier.around_saves(trainer, self, exception):
            super().on_exception(trainer, pl_module, exception)
        self._tier.close(self.checkpoint_io.wait)  # (Lightning calls no teardown after an exception)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        with self._in(Hook.EPOCH_END, trainer):
            super().on_train_epoch_end(trainer, pl_module)
            self._after_fresh_value(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        with self._in(Hook.VALIDATION_END, trainer):
            super().on_validation_end(trainer, pl_module)
            # a value that closes an epoch is ranked at its end when ModelCheckpoint saves there, so that the file
            # holds ModelCheckpoint's loop state (a resume neither runs that epoch's end again nor saves it twice)
            if not (self._should_save_on_train_epoch_end(trainer)
                    and getattr(trainer.fit_loop.epoch_loop.batch_progress, "is_last_batch", False)):
                self._after_fresh_value(trainer)

    def _after_fresh_value(self, trainer: Any) -> None:
        """Monitoring is a trigger of its own: a fresh value is ranked now (saved if it enters the top k), and a
        scheduled save that waited for it happens with it."""
        metrics = trainer.callback_metrics
        if not self._decision.ranks_now(metrics, trainer.global_step) or self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        if self.monitor in candidates:
            self._save_topk_checkpoint(trainer, candidates)
            if self._last_global_step_saved == trainer.global_step:
                self._save_last_checkpoint(trainer, candidates)

    def _monitor_candidates(self, trainer: Any) -> dict[str, Any]:
        return self._decision.candidates(super()._monitor_candidates(trainer))

    def _save_topk_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        """Lightning's top-k save, called by every trigger, as the save decision says (module doc)."""
        batch_end = self._hook is Hook.BATCH_END
        verdict = self._decision.verdict(
            monitor_candidates, trainer.callback_metrics, trainer.global_step, self.save_top_k, batch_end=batch_end,
            validation_follows=batch_end and _lightning_adapter.validation_follows_batch(trainer))
        if verdict is Verdict.RANKED and self.check_monitor_top_k(trainer, monitor_candidates[str(self.monitor)]):
            self.current_score_step = trainer.global_step
        with _for_now(self, "_verdict", verdict, Verdict.PLAIN):
            if verdict in (Verdict.PLAIN, Verdict.RANKED):
                super()._save_topk_checkpoint(trainer, monitor_candidates)
            elif verdict is Verdict.UNRANKED:
                filepath = self._get_metric_interpolated_filepath_name(monitor_candidates, trainer)
                self._preservation.ledger.saving_unranked(filepath)  # first: it is part of the file's state
                self._save_checkpoint(trainer, filepath)
                self._retain(trainer)

    def _save_last_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        if self._decision.waiting == trainer.global_step:
            return  # saved together with the file that waits for this step's value
        with _for_now(self, "_verdict", Verdict.LAST, Verdict.PLAIN):
            super()._save_last_checkpoint(trainer, monitor_candidates)
        self._retain(trainer)  # a file kept only because "last" linked to it can go now

    # -- saving, retention, links (_retention) -------------------------------------------------------------------
    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        if self.verbose and self._verdict is not Verdict.RANKED:  # (ModelCheckpoint logs a ranked save itself)
            _log_save(self, trainer, filepath)
        if self._verdict is Verdict.LAST:  # the last file (any CHECKPOINT_NAME_LAST template) is not one of the newest
            super()._save_checkpoint(trainer, filepath)
            _loggers.log_whole_units(trainer, self)  # the .data (or folder) beside what the loggers just logged
            return
        self._preservation.ledger.saving(filepath)  # before the save: the file's own state lists it, so a resume can rotate it
        super()._save_checkpoint(trainer, filepath)
        _loggers.log_whole_units(trainer, self)
        if self.keep_newest is not None or self._preservation.ledger.waiting:  # (a half-written folder "last" skipped waits too)
            self._retain(trainer)

    def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
        """Lightning drops a file from its top k (or replaces last): delete it once nothing else keeps it."""
        self._preservation.ledger.waiting.add(filepath)
        self._retain(trainer)

    def _retain(self, trainer: Any) -> None:
        resumed = os.fspath(trainer.ckpt_path) if trainer.ckpt_path else None
        for path in self._preservation.release({*self.best_k_models, self.best_model_path}, self.last_model_path,
                                               resumed, self._store):
            if self._should_remove_checkpoint(trainer, path, self.last_model_path or ""):
                trainer.strategy.remove_checkpoint(path)

    def _should_remove_checkpoint(self, trainer: Any, previous: str, current: str) -> bool:
        return self._preservation.deletable(self.dirpath, previous, current, self._store, lambda: bool(
            super(OrtCheckpointMixin, self)._should_remove_checkpoint(trainer, previous, current)))

    def _confined(self, path: str) -> bool:
        """Whether this callback may delete ``path`` or link there or to it (``_registry.belongs``)."""
        return self._preservation.confined(self.dirpath, path, self._store)

    def _link_checkpoint(self, trainer: Any, filepath: str, linkpath: str) -> None:  # type: ignore[override]
        _link(self, trainer, filepath, linkpath)

    # -- resume (_registry, _resume) -----------------------------------------------------------------------------
    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """Lightning's question for "last", whose answers it dates: :meth:`resolve_last` (:func:`_datable`)."""
        return {_datable(self, found)} if (found := self.resolve_last(trainer)) else set()

    def resolve_last(self, trainer: Any, *, at_setup: bool = False) -> str | None:
        """What ``ckpt_path="last"`` resumes from (``_resume``). With peer copies, nothing is read before
        ``setup`` (``at_setup``): the listing's newest, then the choice again once the copies are back."""
        return _resolve_last(self, trainer, at_setup)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "current_score_step": self.current_score_step,
                **self._preservation.state_dict(), **self._decision.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.current_score_step = state_dict.get("current_score_step")
        self._decision.load_state_dict(state_dict)
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:  # only our own files, and never trusted beyond
            self._preservation.restore(state_dict, (*self.best_k_models, self.kth_best_model_path,
                                                    self.best_model_path, self.last_model_path), self.dirpath, self._store)

    @property
    def _saved(self) -> list[str]:
        """The files saved for top-k or periodically, oldest first."""
        return self._preservation.ledger.saved


def _check_arguments(plugin_class: type, dirpath: Any, triggers: dict[str, Any], keep_newest: int | None,
                     include_optimizer_state: bool | None, save_weights_only: bool, checkpoint_io: Any,
                     settings: dict[str, Any], resume_fallback: str, export_best_to: Any) -> None:
    if dirpath is not None and not isinstance(dirpath, (str, os.PathLike)):
        raise CheckpointConfigError(f"dirpath must be a folder's path or URL (a str or os.PathLike) or None, got "
                                    f"{type(dirpath).__name__} {dirpath!r}")
    for name, value in triggers.items():
        if name != "train_time_interval" and value < 0:
            raise CheckpointConfigError(f"{name} must be >= 0, got {value}")
    if keep_newest is not None and keep_newest < 1:
        raise CheckpointConfigError(f"keep_newest must be None or >= 1, got {keep_newest}")
    if include_optimizer_state and save_weights_only:
        raise CheckpointConfigError("include_optimizer_state=True contradicts save_weights_only=True: they are one "
                                    "setting (include_optimizer_state=False is save_weights_only=True); give one")
    if checkpoint_io is not None and settings:
        raise CheckpointConfigError(f"{', '.join(settings)} configure the plugin: pass them to the "
                                    "OrtCheckpointIO given as checkpoint_io, not to OrtCheckpoint")
    if checkpoint_io is not None and not isinstance(checkpoint_io, plugin_class):
        raise CheckpointConfigError(f"checkpoint_io must be a {plugin_class.__module__}.{plugin_class.__qualname__}, "
                                    f"got {type(checkpoint_io).__name__}")
    if resume_fallback not in ("raise", "scratch"):
        raise CheckpointConfigError(f'resume_fallback must be "raise" or "scratch", got {resume_fallback!r}')
    if export_best_to is not None and not _EXPORTER:
        raise CheckpointConfigError("export_best_to needs lightning_ort_ckpt's export callback: import OrtCheckpoint "
                                    "from lightning_ort_ckpt or lightning_ort_ckpt.lightning")


@contextlib.contextmanager
def _for_now(callback: OrtCheckpointMixin, name: str, value: Any, after: Any) -> Iterator[None]:
    """``callback.<name>`` is ``value`` for the block (the hook a save happens in, what the save is), then
    ``after``: one explicit state each, never a flag read beside another."""
    setattr(callback, name, value)
    try:
        yield
    finally:
        setattr(callback, name, after)


def _link(callback: OrtCheckpointMixin, trainer: Any, filepath: str, linkpath: str) -> None:
    """save_last="link": a relative symlink (and one for ``.data``), made once ``filepath`` is durable; on a store
    without links, a copy, independent of ``filepath`` from then on. Every rank raises, or none."""
    refused: Exception | None = None
    if not (callback._confined(filepath) and callback._confined(linkpath)):
        refused = CheckpointError(f"save_last='link' links only checkpoints inside dirpath {callback.dirpath!r}; "
                                  f"refusing to link {linkpath!r} to {filepath!r}", linkpath)
    store = callback._store()
    if refused is None and trainer.is_global_zero and store.absolute(filepath) != store.absolute(linkpath):
        refused = _ranks.attempt(lambda: callback.checkpoint_io.link(filepath, linkpath), filepath, linkpath)
        if refused is None:  # queued behind the save of filepath when asynchronous
            callback._preservation.linked(filepath, linkpath, callback._store)
    _ranks.raise_together(trainer, refused, filepath, linkpath)


def _agree_on_last(callback: OrtCheckpointMixin, trainer: Any, stage: str) -> None:
    """Every rank checks ``dirpath`` and resumes from what rank 0 resolved "last" to (``_ranks``, ``_resume``); a
    sharded load that fails on any rank falls back on every rank (F2)."""
    dirpath = os.fspath(callback.dirpath) if callback.dirpath is not None else None  # rank 0's (ModelCheckpoint's)
    io, resumption = callback.checkpoint_io, callback._resumption
    resumption.agree(lambda mine, adopt: _ranks.agree(trainer, dirpath, callback._store(), stage == "fit", mine, adopt),
                     str(dirpath), io, callback._store)
    fallback = callback._stand_in.loading(trainer, resumption.loading(
        _ranks.all_ranks(trainer), str(dirpath), lambda path: _lightning_adapter.set_resumed_path(trainer, path)))
    if fallback is not None:
        _lightning_adapter.wrap_next_load(trainer.strategy, fallback)


def _resolve_last(callback: OrtCheckpointMixin, trainer: Any, at_setup: bool) -> str | None:
    """:meth:`OrtCheckpointMixin.resolve_last`: ``dirpath`` listed as Lightning resolves it, every tier's
    candidates merged nearest first, and rank 0 reading them until one resumes."""
    directory = _lightning_adapter.resolve_ckpt_dir(callback, trainer)  # as Lightning does
    name = callback.CHECKPOINT_NAME_LAST
    entries = _registry.scan(directory, callback._store(directory), extension=callback.FILE_EXTENSION,
                             last_name=name,  # sub-folders
                             recursive="/" in (callback.filename or "") + name,
                             remote_metadata=callback._tier.reads_remote_folders) if directory else []
    rank_zero = trainer.global_rank == 0
    if rank_zero and not at_setup:
        callback._preservation.take_half(entries)
    entries = callback._tier.nearest_first(entries, trainer)  # every tier's, nearest first (_tiers)
    reads = rank_zero and (at_setup or not callback._tier.reads_last_at_setup(trainer))
    return callback._resumption.find(entries, str(directory), rank_zero=reads, alone=trainer.world_size == 1,
                                     io=bound_plugin(trainer) or callback.checkpoint_io, store_of=callback._store,
                                     module=trainer.lightning_module)


def _resolve_again(callback: OrtCheckpointMixin, trainer: Any) -> None:
    """With peer copies (``_peer``), "last" once they are back: rank 0 reads its candidates now, and where that
    changes a rank's choice, the Trainer's load goes to the new one. Every rank raises, or none."""
    before = callback._resumption.choice.path if callback._resumption.choice else None
    found = callback.resolve_last(trainer, at_setup=True)
    stranded = trainer.is_global_zero and before is None and found is not None
    if trainer.strategy.reduce_boolean_decision(stranded, all=False):  # Lightning loads nothing: say so
        raise CheckpointError('ckpt_path="last" found no checkpoint before the peer copies were taken back into the '
                              "fast tier: run the same fit again to resume from them", str(callback.dirpath))
    if found is None or found == before:
        return

    def to_found(load: Callable[[str], Any]) -> Callable[[str], Any]:
        def load_found(path: str) -> Any:
            loaded = load(found)
            _lightning_adapter.set_resumed_path(trainer, found)
            return loaded
        return load_found

    _lightning_adapter.wrap_next_load(trainer.strategy, to_found)


def _own_plugin(plugin_class: type[OrtCheckpointIOMixin], settings: dict[str, Any]) -> OrtCheckpointIOMixin:
    """The callback's own plugin, which it installs and binds in ``setup``: it needs no word of Lightning's
    assignment, so it lets go of the ``checkpoint_io`` setter's wrap at once (making the callback installs nothing)."""
    plugin = plugin_class(**settings)
    plugin._assignment()
    return plugin


def _datable(callback: OrtCheckpointMixin, found: str) -> str:
    """``found`` where Lightning can date it; on a store, a local stand-in (``_lightning_adapter.LastStandIn``)."""
    store = callback._store(found)
    return found if store.local else callback._stand_in.path_for(found, store.modified(found))


def _forget_last(callback: OrtCheckpointMixin) -> None:
    """At teardown: what "last" resolved to is this fit's only (its stand-in, if any, deleted)."""
    callback._resumption.choice = None
    callback._stand_in.drop()


def _check_copy(callback: OrtCheckpointMixin, trainer: Any) -> None:
    """The Trainer would add its own ModelCheckpoint beside a callback of the other copy of Lightning."""
    ns = namespace_of(trainer)
    if not isinstance(callback, ns.attr("callbacks.Callback")):
        right = "lightning_ort_ckpt.lightning" if ns.trainer.__name__ == "lightning.pytorch" else "lightning_ort_ckpt"
        raise CheckpointError(f"this OrtCheckpoint is for the other copy of Lightning than the Trainer's "
                              f"({ns.trainer.__name__}; pytorch_lightning and lightning.pytorch do not mix): use "
                              f"OrtCheckpoint from {right}")


def _install_plugin(callback: OrtCheckpointMixin, trainer: Any) -> OrtCheckpointIOMixin:
    """The plugin the callback writes through: the Trainer's ``OrtCheckpointIO`` when it has one and the callback
    was given no settings; else the callback's own, installed on the Trainer in place of Lightning's default."""
    io = _lightning_adapter.raw_checkpoint_io(trainer.strategy)
    if isinstance(io, OrtCheckpointIOMixin) and io is not callback.checkpoint_io:
        if callback._own_io:
            raise CheckpointConfigError(
                "the Trainer already has an OrtCheckpointIO, and OrtCheckpoint was given plugin settings (or "
                "checkpoint_io) of its own: configure one plugin, either in Trainer(plugins=...) or here")
        return io  # the Trainer's plugin, with its settings
    if io is None or type(io) in {ns.fabric_attr("plugins.io.torch_io.TorchCheckpointIO") for ns in loaded()}:
        trainer.strategy.checkpoint_io = callback.checkpoint_io
    elif io is not callback.checkpoint_io:
        raise CheckpointConfigError(f"OrtCheckpoint writes through OrtCheckpointIO, but this Trainer has the "
                                    f"plugin {type(io).__name__}; remove it or pass OrtCheckpointIO")
    return callback.checkpoint_io


def _log_save(callback: OrtCheckpointMixin, trainer: Any, filepath: str) -> None:
    """``verbose=True``: one line per save, as ModelCheckpoint's: what, where, why."""
    what = {Verdict.LAST: "the last checkpoint", Verdict.UNRANKED: "an unranked checkpoint"}.get(
        callback._verdict, "a checkpoint")
    why = callback._hook.value
    if callback._verdict is Verdict.UNRANKED:
        value = callback._decision.current
        why += (f"; {callback.monitor!r}={float(value.value):0.5f} was computed at step {value.step}, not this "
                "one: not ranked, kept as one of the newest")
    namespace_of(trainer).attr("utilities.rank_zero_info")(
        f"Epoch {trainer.current_epoch:d}, global step {trainer.global_step:d}: saving {what} to {filepath!r} "
        f"({why})")


def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, CheckpointWarning, stacklevel=3)


class OrtCheckpoint(OrtCheckpointMixin, ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` writing ORT checkpoints, for ``pytorch_lightning`` Trainers (module doc)."""
