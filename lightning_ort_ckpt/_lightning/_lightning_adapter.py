"""Every private Lightning name this project uses, in one place: a new Lightning release is this file to check.

Supported: ``pytorch-lightning`` / ``lightning`` from the floor pinned in ``pyproject.toml`` (2.5.3, the first with
``ModelCheckpoint(save_on_exception=...)``) to the newest release; ``scripts/floor.sh`` (run by ``.ci/run``) runs the
smoke tests on the floor, the whole suite runs on the newest.

What it holds:

- **reads and calls** of private attributes (:func:`raw_checkpoint_io`, :func:`resolve_ckpt_dir`,
  :func:`logger_log_model`, :func:`validation_follows`, :func:`trainer_of`, :func:`restart_train_iterator`,
  :func:`train_loaders`, :func:`prefetched_batches`, :func:`saved_before_validation`) and
  of the fit loop's private state layout (:func:`fit_loop_state_at_step`, :func:`loops_into_validation`,
  :func:`settle_validation_restart`): functions here;
- **overrides and calls** of ``ModelCheckpoint``'s private methods by ``OrtCheckpoint``: listed in
  :data:`MODEL_CHECKPOINT_PRIVATE` (the tests check that every supported Lightning has them);
- **the per-strategy wrap** of ``save_checkpoint``/``load_checkpoint`` (:func:`wrap_strategy_checkpointing`): the
  sharded strategies (``ModelParallelStrategy``, ``FSDPStrategy``) save and load without the ``CheckpointIO``
  (torch.distributed.checkpoint, ``torch.load``); while an ``OrtCheckpointIO`` is bound to such a strategy
  instance, these methods (and ``teardown``, which ends the plugin's work too) are ours (``_strategies``), set on
  that instance only and removed at the plugin's ``teardown`` (a strategy of several processes that saves through
  the ``CheckpointIO``, DDP, has them wrapped as well, for every rank's random states). The strategy's save mode is
  read here (:func:`sharded_state_dict`). Every strategy a plugin is bound to has its ``process_dataloader`` wrapped on that
  instance too (:func:`wrap_process_dataloader`), until the plugin is bound again, to learn the training loaders
  before their first iterator is drawn (and that the fit's optimizers exist: the staging memory arms then);
- **"last" on a store** (:class:`LastStandIn`): Lightning resolves ``ckpt_path="last"`` before any callback hook,
  from each checkpoint callback's ``_find_last_checkpoints`` (``OrtCheckpoint`` answers with the checkpoint its
  registry resolves: newest by the step it records, one that can resume), then asks the file system of each
  answer for its modification time (``fsspec``, without the callback's ``storage_options``), which a checkpoint
  folder on an object store (``s3://``, ``memory://``) does not have (``IsADirectoryError``) and a store that needs
  its options cannot give. So a checkpoint on a store is answered by a local empty file dated as the checkpoint;
  Lightning's next ``load_checkpoint`` of it is a load of the checkpoint, which becomes the Trainer's
  ``ckpt_path``, and the file is deleted in the callback's ``setup`` (or ``teardown``). Nothing of Lightning's is
  wrapped for it but that one load, on that Trainer's strategy instance (:func:`wrap_next_load`), as the F2
  fallback does: it wraps one ``load_checkpoint`` for one load and names the checkpoint it fell back to as the
  Trainer's ``ckpt_path`` (:func:`set_resumed_path`);
- **the setter** ``Strategy.checkpoint_io`` of Lightning's base strategy classes (Trainer's and Fabric's), wrapped
  while an ``OrtCheckpointIO`` made by the user exists unbound (:data:`CHECKPOINT_IO_ASSIGNMENT`, deprecated: a plugin
  lets go of it when bound, else the garbage collector releases it; the one process-wide wrap left: ARCHITECTURE.md,
  "What is global"; ``OrtCheckpoint``'s own plugin lets go of it at once): it tells the plugin which strategy it
  serves; a Fabric
  strategy's ``save_checkpoint`` is wrapped per instance until the plugin's teardown (:func:`wrap_fabric_save`),
  and a Trainer unpickled in a spawned process is found from the calling frames (:func:`calling_strategy`: it reads
  them, installs nothing);
- **the loader wrap** of a Lightning function, :data:`ORT_LOADING`: Lightning's torch loader (``_load``, bound as
  ``pl_load`` in ``core.saving`` and in ``TorchCheckpointIO``'s module) learns to read ORT files, recognized by
  content; every other file goes to Lightning's own function, unchanged. It is what lets
  ``LightningModule.load_from_checkpoint`` read ORT files. Nothing installs it at import nor when one of our objects
  is made: it is on after ``lightning_ort_ckpt.enable_ort_loading()`` (an explicit, process-wide opt-in) and within
  one call of ours (``lightning_ort_ckpt.load_from_checkpoint``, export), and Lightning's own function is put back
  when every request is undone. Within :func:`serving` it hands back a checkpoint dict already read instead of
  reading the file again (export reads the weights once, then builds the module with ``load_from_checkpoint``).
  The spawn/fork launchers' hand-over of the worker's weights (:func:`launcher_weights`: ``_MultiProcessingLauncher``
  reads them with the main process's own ``CheckpointIO``, Lightning's ``TorchCheckpointIO`` where the worker's
  callback installed ours) needs no wrap: the worker's plugin writes that file with Lightning's torch writer.
- **the imports of a save**: Lightning's ``dump_checkpoint`` imports ``omegaconf`` (where installed) at the first
  save of a process. A save from a signal handler (SLURM's requeue) that interrupts that import finds the module
  half initialized and fails, and the fit with it (``ImportError``: ``benchmarks/signals.py`` met it in 4 of 50
  SIGUSR1s). :func:`import_what_saves_import` makes that import when a plugin is bound, before any save: an import
  Lightning makes anyway, only earlier.

This module imports neither torch nor Lightning, and of ours only the format's file identifier.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import os
import shutil
import sys
import tempfile
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ..format._schema import FILE_IDENTIFIER

# (module, attribute) of Lightning's torch loader, per copy of Lightning: what ORT_LOADING wraps
LOADER_BINDINGS = (
    ("pytorch_lightning.core.saving", "pl_load"),
    ("lightning_fabric.plugins.io.torch_io", "pl_load"),
    ("lightning.pytorch.core.saving", "pl_load"),
    ("lightning.fabric.plugins.io.torch_io", "pl_load"),
)

MODEL_CHECKPOINT_PRIVATE = (
    # methods OrtCheckpoint overrides (ModelCheckpoint calls them)
    "_save_topk_checkpoint", "_save_last_checkpoint", "_save_checkpoint", "_remove_checkpoint", "_link_checkpoint",
    "_find_last_checkpoints", "_monitor_candidates",
    # methods it calls
    "_should_skip_saving_checkpoint", "_get_metric_interpolated_filepath_name", "_should_remove_checkpoint",
    "_ModelCheckpoint__resolve_ckpt_dir", "_should_save_on_train_epoch_end",
)
"""The private methods of ``ModelCheckpoint`` that ``OrtCheckpoint`` overrides or calls."""

MODEL_CHECKPOINT_ATTRIBUTES = ("_every_n_train_steps", "_every_n_epochs", "_train_time_interval",
                               "_last_global_step_saved")
"""The private attributes of a ``ModelCheckpoint`` set here for ``OrtCheckpoint`` (the triggers, to combine them:
:func:`set_triggers`) or that it reads (the step it saved last). Its ``_fs`` is replaced here, to pass
``storage_options`` (:func:`set_checkpoint_filesystem`)."""

_MARK = "reads_ort_checkpoints"
_SERVED: contextvars.ContextVar[tuple[str, Any] | None] = contextvars.ContextVar("ort_ckpt_served", default=None)


def import_what_saves_import() -> None:
    """Import what Lightning's ``dump_checkpoint`` imports at the first save (module doc, "the imports of a
    save")."""
    with contextlib.suppress(ImportError):
        import omegaconf  # noqa: F401


def raw_checkpoint_io(strategy: Any) -> Any:
    """The ``CheckpointIO`` given to ``strategy``, or None: the public ``checkpoint_io`` property would create and
    install a ``TorchCheckpointIO`` when there is none."""
    return strategy.__dict__.get("_checkpoint_io")


def logger_log_model(logger: Any) -> Any:
    """A logger's ``log_model`` setting (``MLFlowLogger``, ``WandbLogger``, ``LitLogger``: False, True or "all"),
    kept only as ``_log_model``; False for loggers without it."""
    return getattr(logger, "_log_model", False)


def hparams_name(module: Any) -> Any:
    """The name of the ``__init__`` argument ``save_hyperparameters(obj)`` was given (``_hparams_name``), or None:
    ``load_from_checkpoint`` passes the whole hparams as that argument."""
    return getattr(module, "_hparams_name", None)


def resolve_ckpt_dir(callback: Any, trainer: Any) -> Any:
    """The directory ``ModelCheckpoint`` saves into for this trainer (its ``dirpath``, or the logger's)."""
    return callback._ModelCheckpoint__resolve_ckpt_dir(trainer)


def set_triggers(callback: Any, every_n_train_steps: int | None, every_n_epochs: int | None,
                 train_time_interval: Any) -> None:
    """Give a ``ModelCheckpoint`` several triggers at once (its ``__init__`` takes one): each is checked on its own in
    its hooks."""
    callback._every_n_train_steps = every_n_train_steps or 0
    callback._every_n_epochs = every_n_epochs or 0
    callback._train_time_interval = train_time_interval


def set_checkpoint_filesystem(callback: Any, dirpath: str, storage_options: dict[str, Any]) -> None:
    """Give ``ModelCheckpoint``'s own file-system calls (``_fs``: does a file exist, is the folder empty) the
    ``storage_options`` of its ``dirpath``; Lightning builds it without options."""
    from fsspec.core import url_to_fs

    callback._fs = url_to_fs(dirpath, **storage_options)[0]


def validation_follows(trainer: Any) -> bool | None:
    """The epoch loop's own test of whether validation runs after the current training batch; None where this
    Lightning has no such test."""
    loop = trainer.fit_loop
    try:
        return bool(loop.epoch_loop._should_check_val_fx(loop._data_fetcher))
    except AttributeError:
        return None


def validation_follows_batch(trainer: Any) -> bool:
    """Whether validation runs right after this training batch, at this same step.

    Asks the epoch loop's own test (Lightning calls it right after this hook; it reads the batch index and whether
    this is the last batch, both already final here). Validation by elapsed time is judged a moment early, so a save
    may then be written unranked just before a value it could have waited for.
    """
    batches = trainer.num_val_batches
    if not (sum(batches) if isinstance(batches, list) else batches):
        return False
    follows = validation_follows(trainer)
    if follows is None:  # another Lightning version: ModelCheckpoint's own rule, the epoch's last batch
        every = trainer.check_val_every_n_epoch
        return bool(getattr(trainer.fit_loop.epoch_loop.batch_progress, "is_last_batch", False)) and (
            every is None or (trainer.current_epoch + 1) % every == 0)
    return follows


def saved_before_validation(trainer: Any) -> str | None:
    """Whether a save now is at the end of a training batch (its hooks run, the batch not yet counted completed)
    that validation follows (the fit's last step too: a fit resumed with more steps runs it): ``"batches"`` where
    the batch-count rule decides it, which a resumed fit asks again; ``"other"`` where elapsed time or
    ``should_stop`` does, which a fresh Trainer cannot answer the same way; None where no validation follows
    (``_validation_resume``)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    at_end = all(p.ready == p.started == p.processed == p.completed + 1 for p in (progress.total, progress.current))
    val = trainer.fit_loop.epoch_loop.val_loop.batch_progress.total
    if not (at_end and val.ready == val.started == val.processed == val.completed and trainer.training
            and not trainer.sanity_checking and validation_follows_batch(trainer)):
        return None
    timed = getattr(trainer, "_val_check_time_interval", None) is not None
    return "other" if timed or trainer.should_stop else "batches"


def loops_into_validation(loops: Any) -> bool:
    """Rewrite a checkpoint's loop state saved by :func:`saved_before_validation` (Lightning's "restarted on train
    batch end", which resumes past that batch's validation, and past the end of its epoch on the epoch's last batch)
    into the state of a save inside that validation, at its first batch: the training batch completed, one
    validation batch started, none processed. Lightning's own restart "mid evaluation" then runs the whole
    validation, ends the epoch where it was the last batch, and trains on. False (nothing changed) where the state
    is not that of such a save. :func:`settle_validation_restart` takes the started batch back once the loops chose
    their restart."""
    fit = loops.get("fit_loop") if isinstance(loops, dict) else None
    train: Any = fit.get("epoch_loop.batch_progress") if isinstance(fit, dict) else None
    val: Any = fit.get("epoch_loop.val_loop.batch_progress") if isinstance(fit, dict) else None
    if not isinstance(train, dict) or not isinstance(val, dict):
        return False
    try:
        parts, total = [train["total"], train["current"]], val["total"]
        if not (all(p["ready"] == p["started"] == p["processed"] == p["completed"] + 1 for p in parts)
                and total["ready"] == total["started"] == total["processed"] == total["completed"]):
            return False
    except (KeyError, TypeError):
        return False
    for p in parts:
        p["completed"] = p["processed"]
    total["ready"] = total["started"] = total["completed"] + 1  # counted over the epoch's validations
    val["current"] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}  # this validation's
    val["is_last_batch"] = False
    return True


def settle_validation_restart(trainer: Any) -> bool:
    """When training starts, after the loops chose to restart inside validation (:func:`loops_into_validation`):
    the validation batch counted started, which no run processed, is not counted, so the loops count each
    validation batch once, as the uninterrupted run's do. Returns whether the epoch loop runs that validation (a
    Trainer whose validation settings differ from the saving run's may not)."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    if not val_loop.restarted_mid_evaluation:
        return False
    for p in (val_loop.batch_progress.total, val_loop.batch_progress.current):
        p.ready = p.started = p.completed
    return bool(validation_follows(trainer))


def set_resumed_path(trainer: Any, path: str) -> None:
    """The Trainer's ``ckpt_path`` (what it resumed from) is ``path``: where a failed load fell back to. The public
    setter would also mark it as set by the user."""
    trainer._checkpoint_connector._ckpt_path = path


def wrap_next_load(strategy: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """The next ``strategy.load_checkpoint(path, ...)`` of this instance goes through ``wrap(load)`` (``load``: the
    method as it is now, ours where the plugin routes it), once; then the method is what it was."""
    before = strategy.__dict__.get("load_checkpoint")
    current = strategy.load_checkpoint

    def load_once(path: Any, *args: Any, **kwargs: Any) -> Any:
        if before is None:
            strategy.__dict__.pop("load_checkpoint", None)
        else:
            strategy.__dict__["load_checkpoint"] = before
        return wrap(lambda p: current(p, *args, **kwargs))(path)

    setattr(load_once, _MARK, getattr(before, _MARK, False))  # the plugin's unwrap removes it with its own
    strategy.__dict__["load_checkpoint"] = load_once


def trainer_of(module: Any) -> Any:
    """The Trainer a LightningModule is attached to, or None (``module.trainer`` raises when there is none)."""
    return module._trainer


def resumed_inside_epoch(trainer: Any, saved_epoch: Any) -> bool:
    """Whether this fit resumed inside the epoch the checkpoint was saved in, with that epoch's data iterator drawn
    before the save in the uninterrupted run: the fit loop restarts mid-epoch (its own restart stage, Lightning >=
    2.6) in the saved epoch. A file saved on the last batch of an epoch restarts "mid-epoch" in the next one, whose
    iterator the uninterrupted run drew after the save; so does one saved after fit ended, at no stage at all."""
    inside = getattr(trainer.fit_loop, "restarted_mid_epoch", True)
    return bool(inside) and trainer.current_epoch == saved_epoch


def restart_train_iterator(trainer: Any) -> None:
    """Draw the training data iterator again, as the fit loop does at the start of an epoch (``iter`` of its data
    fetcher): a resume at an epoch boundary then shuffles the next epoch from the random states it restored, as the
    uninterrupted run did."""
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is not None:
        iter(fetcher)


def wrap_process_dataloader(strategy: Any, watch: Callable[[Any], None]) -> Callable[[], None]:
    """Have ``strategy.process_dataloader`` (this instance only) hand every loader it returns to ``watch``, a bound
    method: the last step Lightning takes on a loader before the fit loop draws its first iterator
    (``_data_position``). Returns what puts Lightning's method back. Neither holds the other's owner: the wrap holds
    ``watch`` weakly (the strategy keeps the wrap, and must not keep the watcher alive), the undo holds the strategy
    weakly and knows the wrap by a token (the watcher keeps the undo), and the wrap, kept in the strategy's
    ``__dict__``, holds Lightning's method weakly: no reference cycle through any of them."""
    found = getattr(strategy, "process_dataloader")  # Lightning's bound method: held weakly, it holds the strategy
    original = weakref.WeakMethod(found) if isinstance(found, types.MethodType) else (lambda: found)
    watcher = weakref.WeakMethod(watch)
    token = object()

    def process_dataloader(dataloader: Any) -> Any:
        method = original()
        assert method is not None  # (the strategy that holds this wrap is alive while it is called)
        processed = method(dataloader)
        watching = watcher()
        if watching is not None:
            watching(processed)
        return processed

    setattr(process_dataloader, _MARK, token)
    strategy.__dict__["process_dataloader"] = process_dataloader
    owner = weakref.ref(strategy)

    def unwrap() -> None:
        wrapped = owner()
        if wrapped is not None and getattr(wrapped.__dict__.get("process_dataloader"), _MARK, None) is token:
            del wrapped.__dict__["process_dataloader"]

    return unwrap


def train_loaders(trainer: Any) -> list[Any]:
    """The training loaders the fit loop draws batches from (its combined loader's, in order); [] before it has
    them."""
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return list(combined.flattened) if combined is not None else []


def prefetched_batches(trainer: Any) -> int:
    """How many batches the fit loop's data fetcher holds ahead of training (a loader without a length)."""
    return len(getattr(getattr(trainer.fit_loop, "_data_fetcher", None), "batches", None) or ())


def last_step_saved(callback: Any) -> int:
    """The step of a ``ModelCheckpoint``'s newest save (its ``_last_global_step_saved``): alike on every rank."""
    return int(callback._last_global_step_saved)


def batches_in_flight(trainer: Any) -> int:
    """Batches the fit loop fetched but has not trained yet: 1 for a save from inside a batch (Lightning's SLURM
    requeue handler saves wherever the signal lands), 0 at a batch's end."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return max(0, int(progress.ready) - int(progress.processed))


def train_batches_done(trainer: Any) -> int:
    """How many batches of the current epoch the fit loop has trained (its batch progress)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def fitting(strategy: Any) -> bool:
    """Whether the Trainer of ``strategy``'s module is fitting (``TrainerFn.FITTING``, in either Lightning)."""
    module = strategy.lightning_module
    trainer = trainer_of(module) if module is not None else None
    fn = trainer.state.fn if trainer is not None else None
    return fn is not None and fn.value == "fit"


def fit_loop_state_at_step(fit_loop: Any, step: int) -> dict[str, Any]:
    """A fresh fit loop's state with ``step`` optimizer steps done: Lightning derives ``global_step`` from these
    counters, not from the checkpoint's ``global_step`` key."""
    state = copy.deepcopy(fit_loop.state_dict())
    state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"].update(
        ready=step, completed=step)
    state["epoch_loop.manual_optimization.optim_step_progress"]["total"].update(ready=step, completed=step)
    state["epoch_loop.state_dict"]["_batches_that_stepped"] = step
    return state


def sharded_state_dict(strategy: Any) -> bool | None:
    """Whether the strategy saves a sharded (distributed) state dict: ``ModelParallelStrategy``'s
    ``save_distributed_checkpoint``, ``FSDPStrategy``'s ``state_dict_type="sharded"``; None for other strategies."""
    if "_save_distributed_checkpoint" in strategy.__dict__:
        return bool(strategy._save_distributed_checkpoint)
    if "_state_dict_type" in strategy.__dict__:
        return bool(strategy._state_dict_type == "sharded")
    return None


_STRATEGY_METHODS = ("save_checkpoint", "load_checkpoint", "teardown")


def wrap_strategy_checkpointing(strategy: Any, save: Callable[..., Any], load: Callable[..., Any],
                                teardown: Callable[..., Any]) -> Callable[[], None]:
    """Make ``strategy.save_checkpoint`` / ``load_checkpoint`` / ``teardown`` (this instance only) call
    ``save(original, *args)``, ``load(original, *args)`` and ``teardown(original)``, ``original`` being Lightning's
    bound method; returns the function that puts Lightning's back. ``teardown`` is wrapped because
    ``ModelParallelStrategy.teardown`` does not call its ``CheckpointIO``'s: ours must end with the fit all the same.
    Installed again (after undoing a previous wrap), it wraps Lightning's own methods, never ours. Nothing here
    holds the strategy strongly: the wraps (which it keeps) hold its own bound methods weakly, and the undo (which
    the plugin keeps, and the strategy keeps the plugin) the strategy: no reference cycle through either."""
    unwrap_strategy_checkpointing(strategy)
    for name, ours in zip(_STRATEGY_METHODS, (save, load, teardown)):
        original = getattr(strategy, name)
        held = (weakref.WeakMethod(original) if getattr(original, "__self__", None) is strategy
                else lambda _original=original: _original)  # (another's instance attribute: held as it was)

        def method(*args: Any, _ours: Callable[..., Any] = ours, _held: Callable[[], Any] = held,
                   **kwargs: Any) -> Any:
            return _ours(_held(), *args, **kwargs)

        setattr(method, _MARK, True)
        strategy.__dict__[name] = method
    owner = weakref.ref(strategy)

    def unwrap() -> None:
        wrapped = owner()
        if wrapped is not None:
            unwrap_strategy_checkpointing(wrapped)

    return unwrap


def unwrap_strategy_checkpointing(strategy: Any) -> None:
    """Put Lightning's ``save_checkpoint`` / ``load_checkpoint`` / ``teardown`` back on ``strategy`` (nothing if not
    wrapped)."""
    for name in _STRATEGY_METHODS:
        if getattr(strategy.__dict__.get(name), _MARK, False):
            del strategy.__dict__[name]


# -- the loader wrap --------------------------------------------------------------------------------------------
class OrtLoading:
    """The wrap of Lightning's loader, on while it is asked for (``enable_ort_loading()``, or one call of ours):
    every acquire is counted, the last release puts Lightning's own functions back. ``is_ort`` and ``load_ort`` are
    the reader's (passed in: this module imports none of ours)."""

    def __init__(self) -> None:
        self._holders = 0
        self._lock = threading.Lock()
        self._readers: tuple[Callable[[Any], bool], Callable[[Any, Any], Any]] | None = None
        self._wrapped: list[tuple[types.ModuleType, str, Callable[..., Any]]] = []

    @property
    def on(self) -> bool:
        return self._holders > 0

    def acquire(self, is_ort: Callable[[Any], bool], load_ort: Callable[[Any, Any], Any]) -> None:
        """Hold the wrap on; wrap the copies of Lightning imported since it was last put on."""
        with self._lock:
            self._holders += 1
            self._readers = (is_ort, load_ort)
            for module_name, attr in LOADER_BINDINGS:
                module = sys.modules.get(module_name)
                original = getattr(module, attr, None) if module is not None else None
                if original is not None and not getattr(original, _MARK, False):
                    setattr(module, attr, self._ort_aware(original))
                    self._wrapped.append((module, attr, original))  # type: ignore[arg-type]

    def release(self) -> None:
        """Let go of one hold; the last one puts Lightning's own functions back."""
        with self._lock:
            self._holders = max(0, self._holders - 1)
            if self._holders == 0:
                for module, attr, original in reversed(self._wrapped):
                    setattr(module, attr, original)
                self._wrapped.clear()

    def _ort_aware(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def pl_load(path_or_url: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
            served = _SERVED.get()
            if (served is not None and isinstance(path_or_url, (str, os.PathLike))
                    and os.path.abspath(os.fspath(path_or_url)) == served[0]):
                return served[1]
            assert self._readers is not None
            is_ort, load_ort = self._readers
            if isinstance(path_or_url, (str, os.PathLike)):
                if is_ort(path_or_url):  # a local path, or any URL of a store (http(s) included)
                    return load_ort(path_or_url, map_location)
            elif _is_ort_stream(path_or_url):
                with tempfile.TemporaryDirectory(prefix="ort-ckpt-") as tmp:
                    path = os.path.join(tmp, "checkpoint.ckpt")
                    with open(path, "wb") as f:
                        shutil.copyfileobj(path_or_url, f)
                    return load_ort(path, map_location)
            return original(path_or_url, map_location, *args, **kwargs)

        setattr(pl_load, _MARK, True)
        pl_load.__wrapped__ = original  # type: ignore[attr-defined]
        return pl_load


ORT_LOADING = OrtLoading()


class LastStandIn:
    """``ckpt_path="last"`` on a store Lightning cannot ask a modification time of (module doc): a local empty file,
    dated as the checkpoint it stands for, which ``_find_last_checkpoints`` hands Lightning; the Trainer's load of
    it is a load of the checkpoint (:meth:`loading`), and it is deleted once Lightning has dated it."""

    def __init__(self) -> None:
        self._made: tuple[str, str] | None = None  # (the stand-in, the checkpoint)

    def path_for(self, path: str, modified: float) -> str:
        """A stand-in for ``path`` (``modified``: its time, or ``-inf`` when the store does not know it)."""
        self.drop()
        folder = tempfile.mkdtemp(prefix="ort-ckpt-last-")
        local = os.path.join(folder, os.path.basename(path.rstrip("/")) or "last")
        with open(local, "wb"):
            pass
        when = modified if modified > 0 and modified != float("inf") else 0.0
        os.utime(local, (when, when))
        self._made = (local, path)
        return local

    def loading(self, trainer: Any, wrap: Callable[[Callable[[str], Any]], Callable[[str], Any]] | None
                ) -> Callable[[Callable[[str], Any]], Callable[[str], Any]] | None:
        """The wrap of the Trainer's next load (:func:`wrap_next_load`): the stand-in Lightning chose loads as the
        checkpoint it stands for, which becomes the Trainer's ``ckpt_path``; then ``wrap`` (the fallback), if any.
        The stand-in is deleted here (Lightning dated it already). None where there is nothing to wrap."""
        made, self._made = self._made, None
        self.drop(made)
        if made is None:
            return wrap
        local, real = made

        def mapping(load: Callable[[str], Any]) -> Callable[[str], Any]:
            inner = wrap(load) if wrap is not None else load

            def load_checkpoint(path: str) -> Any:
                if os.fspath(path) == local:
                    set_resumed_path(trainer, real)
                    path = real
                return inner(path)

            return load_checkpoint

        return mapping

    def drop(self, made: tuple[str, str] | None = None) -> None:
        """Delete the stand-in (``made``, or the one made last)."""
        made = made or self._made
        if made is not None:
            shutil.rmtree(os.path.dirname(made[0]), ignore_errors=True)
        if made is self._made:
            self._made = None


@contextlib.contextmanager
def serving(path: str | os.PathLike[str], checkpoint: Any) -> Iterator[None]:
    """Within: Lightning's loader returns ``checkpoint`` for ``path`` instead of reading the file, so
    ``load_from_checkpoint`` builds the module (hparams, ``on_load_checkpoint``, strict loading) from what the caller
    has read already. Only while :data:`ORT_LOADING` is on."""
    token = _SERVED.set((os.path.abspath(os.fspath(path)), checkpoint))
    try:
        yield
    finally:
        _SERVED.reset(token)


LAUNCHER_WEIGHTS_NAME = ".temp.ckpt"
"""The name of the file in which Lightning's spawn and fork launchers (``_MultiProcessingLauncher``) hand the
worker's weights (the module's bare ``state_dict``) to the main process, through each process's ``CheckpointIO``."""


def launcher_weights(path: str | os.PathLike[str], checkpoint: dict[str, Any]) -> bool:
    """Whether a save of ``checkpoint`` to ``path`` is that hand-over: the main process reads it with its own
    ``CheckpointIO`` (Lightning's ``TorchCheckpointIO`` where only the worker's callback installed ours)."""
    return os.path.basename(os.fspath(path)) == LAUNCHER_WEIGHTS_NAME and "state_dict" not in checkpoint


def _is_ort_stream(stream: Any) -> bool:
    """Whether a seekable binary file object holds an ORT checkpoint (its position is left as it was)."""
    if not all(callable(getattr(stream, m, None)) for m in ("read", "seek", "tell")):
        return False
    start = stream.tell()
    head = stream.read(8)
    stream.seek(start)
    return isinstance(head, bytes) and head[4:8] == FILE_IDENTIFIER


# -- the plugin alone: learning the strategy that holds it ------------------------------------------------------
STRATEGY_CLASSES = (
    ("pytorch_lightning.strategies.strategy", "Strategy"),
    ("lightning.pytorch.strategies.strategy", "Strategy"),
    ("lightning_fabric.strategies.strategy", "Strategy"),
    ("lightning.fabric.strategies.strategy", "Strategy"),
)
"""The base ``Strategy`` classes (Trainer's and Fabric's, per copy of Lightning) whose ``checkpoint_io`` setter
:data:`CHECKPOINT_IO_ASSIGNMENT` wraps."""

ASSIGNED_HOOK = "_ort_ckpt_assigned_to"
"""The method a ``CheckpointIO`` of ours has, called with the strategy Lightning gives it to."""


class CheckpointIOAssignment:
    """The wrap of the ``checkpoint_io`` setter of Lightning's base ``Strategy`` classes, on while anyone holds it
    (every ``OrtCheckpointIO`` does, from when it is made until it is bound or freed; deprecated, goes in 0.6): Lightning hands a plugin to its strategy with that setter
    (``_AcceleratorConnector``, for ``Trainer(plugins=[...])`` and ``Fabric(plugins=[...])``, and ``OrtCheckpoint``
    in ``setup``), and a ``CheckpointIO`` gets no other word of which strategy it serves. When the one set has
    :data:`ASSIGNED_HOOK` (bare, or inside Lightning's ``AsyncCheckpointIO``), it is called with the strategy; every
    other assignment is Lightning's own, unchanged. The last release puts Lightning's properties back. Strategies
    that override the property (Fabric's FSDP and ModelParallel, which refuse a ``CheckpointIO``) are left alone."""

    def __init__(self) -> None:
        self._holders = 0
        self._lock = threading.Lock()
        self._wrapped: list[tuple[type, property]] = []

    def acquire(self) -> None:
        with self._lock:
            self._holders += 1
            for module_name, name in STRATEGY_CLASSES:
                module = sys.modules.get(module_name)
                cls = getattr(module, name, None) if module is not None else None
                prop = cls.__dict__.get("checkpoint_io") if cls is not None else None
                if isinstance(prop, property) and prop.fset is not None and not getattr(prop.fset, _MARK, False):
                    setattr(cls, "checkpoint_io", property(prop.fget, _announcing(prop.fset), prop.fdel, prop.__doc__))
                    self._wrapped.append((cls, prop))  # type: ignore[arg-type]

    def release(self) -> None:
        with self._lock:
            self._holders = max(0, self._holders - 1)
            if self._holders == 0:
                for cls, prop in reversed(self._wrapped):
                    setattr(cls, "checkpoint_io", prop)
                self._wrapped.clear()

    def hold_while(self, owner: object) -> Callable[[], object]:
        """Hold the wrap on for as long as ``owner`` exists; returns what lets go of that hold at once (once)."""
        self.acquire()
        return weakref.finalize(owner, self.release)


def _announcing(fset: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    def checkpoint_io(strategy: Any, io: Any) -> None:
        fset(strategy, io)
        ours = io if hasattr(io, ASSIGNED_HOOK) else getattr(io, "checkpoint_io", None)  # AsyncCheckpointIO's
        if hasattr(ours, ASSIGNED_HOOK):
            getattr(ours, ASSIGNED_HOOK)(strategy)

    setattr(checkpoint_io, _MARK, True)
    return checkpoint_io


CHECKPOINT_IO_ASSIGNMENT = CheckpointIOAssignment()


def calling_strategy(io: Any, depth: int = 4) -> Any:
    """The Trainer's strategy whose ``save_checkpoint`` / ``load_checkpoint`` / ``remove_checkpoint`` called ``io``
    (bare or wrapped), found as the ``self`` of one of the ``depth`` calling frames above ``io``'s method; None for a call
    from anywhere else. For a plugin that never saw its strategy's ``checkpoint_io`` setter (the Trainer was
    unpickled in a spawned process)."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        raw = getattr(candidate, "__dict__", {}).get("_checkpoint_io")
        is_strategy = hasattr(type(candidate), "lightning_module")  # not the AsyncCheckpointIO wrapping ``io``
        if is_strategy and raw is not None and (raw is io or getattr(raw, "checkpoint_io", None) is io):
            return candidate
        frame = frame.f_back
    return None


def wrap_fabric_save(strategy: Any, save: Callable[..., Any]) -> Callable[[], None]:
    """Make ``strategy.save_checkpoint`` (this instance of a Fabric strategy) call ``save(original, *args)``: what
    ``fabric.save`` asks is seen before Fabric turns its modules and optimizers into state dicts. Wrapped again, it
    wraps Lightning's own method, never ours. Returns what puts Lightning's method back (the plugin's teardown)."""
    original = type(strategy).save_checkpoint.__get__(strategy)

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        return save(original, *args, **kwargs)

    setattr(save_checkpoint, _MARK, True)
    strategy.__dict__["save_checkpoint"] = save_checkpoint

    def unwrap() -> None:
        if strategy.__dict__.get("save_checkpoint") is save_checkpoint:
            del strategy.__dict__["save_checkpoint"]

    return unwrap
