"""``OrtCheckpoint``: Lightning's ``ModelCheckpoint``, writing ORT checkpoints, with the fixes its users ask for.

It takes every ``ModelCheckpoint`` argument with the same meaning (it *is* a ``ModelCheckpoint``, so
``ckpt_path="last"`` and ``"best"`` resolve to its files) and installs :class:`OrtCheckpointIO` by itself. On top:

- **Triggers combine.** ``every_n_train_steps``, ``every_n_epochs`` and ``train_time_interval`` may be given together;
  with ``monitor`` set, every fresh value of the monitored metric (a validation run, a logged epoch metric) is a
  trigger too: a save "on improvement" when it enters the top ``save_top_k``.
- **No stale ranking.** A save is ranked by the monitored value only if that value was computed at the step being
  saved; a fresh value is ranked exactly as ``ModelCheckpoint`` ranks it. A scheduled save at a step where the value
  is older (say every 100 steps, with validation once per epoch) is written unranked and kept as one of the newest
  files (``keep_newest``; without it, only the newest unranked file is kept); the value gets ranked when it is next
  computed. When validation computes it right after this very step (the last batch of an epoch), the save waits for
  it instead. Every file records the step its monitored value comes from (``current_score_step`` in its state).
- **Keep the newest N** (``keep_newest``, ORT's ``max_num_checkpoints``) next to the top-k by metric. Nothing in the
  top k, the best file, the last file or a file training was told to resume from is ever deleted, nothing before
  the new file is durable, and nothing but a checkpoint inside ``dirpath`` (``..`` and links resolved; paths
  restored from a file are not trusted further).
- **Saves where ModelCheckpoint saves**: a validation value that closes an epoch is ranked at ``on_train_epoch_end``
  when ``save_on_train_epoch_end`` resolves to True, so the file holds ModelCheckpoint's loop state and resumes
  the same way (EarlyStopping, a second ``fit`` on the same Trainer). A file of a ModelCheckpoint with the same
  monitor, mode and triggers hands its ranking over on resume.
- **Asynchronous saving** (``async_save=True``): training goes on while the file is written; see OrtCheckpointIO.
- **Remote ``dirpath``** (``s3://...``, any fsspec URL, with ``storage_options``): files are uploaded whole or not at
  all (``format.storage``), listed and deleted on the store; ``save_last="link"``, which ModelCheckpoint refuses
  there, becomes a copy. A ``file://`` URL is the local path it names (ModelCheckpoint makes a folder ``file:``).
- **"last" falls back**: ``ckpt_path="last"`` resumes from the newest checkpoint in ``dirpath`` that can resume a
  fit, skipping (with a warning) unreadable and weights-only files.
- **Exact resume from any save point**: the random states are applied again at ``on_train_start`` when a checkpoint
  saved inside its epoch (at validation end, or mid-epoch) resumes, which the plugin alone cannot do.
- ``include_optimizer_state=False`` writes parameters only (small deploy files), like ORT's flag of that name; it is
  ``save_weights_only=True`` under the ORT name.
- ``export_best_to="model.onnx"`` exports the best checkpoint (the last one without ``monitor``) when fit ends, as
  an ONNX inference model verified against ONNX Runtime (see ``lightning_ort_ckpt.export``); the report is in
  ``export_report``.
"""

from __future__ import annotations

import json
import os
import posixpath
import warnings
import zipfile
from datetime import timedelta
from typing import Any, Literal

from pytorch_lightning.callbacks import ModelCheckpoint

from .errors import CheckpointError, CheckpointWarning
from .format import load_checkpoint, open_checkpoint
from .format import _store
from .format._store import StorageOptions
from .format._writer import ExternalData
from ._namespaces import loaded, namespace_of
from ._torch_files import load_torch_file
from ._translation.lightning_dict import MANIFEST, from_ort
from . import _lightning_adapter, _rng
from ._plugin import RNG_KEY, OrtCheckpointIOMixin, is_ort_checkpoint, plugin_class_for


class OrtCheckpointMixin:
    """The behaviour of ``OrtCheckpoint``, shared by the ``pytorch_lightning`` and ``lightning.pytorch`` classes."""

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        *,
        include_optimizer_state: bool = True,
        keep_newest: int | None = None,
        async_save: bool = False,
        external_data: ExternalData = "auto",
        ort_compatible: bool = False,
        share_frozen: bool | Literal["trusted"] = True,
        export_best_to: str | os.PathLike[str] | None = None,
        export_tolerance: float = 1e-5,
        storage_options: StorageOptions | None = None,
    ) -> None:
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if keep_newest is not None and keep_newest < 1:
            raise ValueError(f"keep_newest must be None or >= 1, got {keep_newest}")
        if keep_newest is not None and monitor is None and save_top_k == 1:
            save_top_k = -1  # without a metric, keep_newest alone decides which files go
        # ModelCheckpoint accepts one trigger; give it the first and set the others afterwards (they are checked
        # independently in its hooks).
        triggers = {"every_n_train_steps": every_n_train_steps, "every_n_epochs": every_n_epochs,
                    "train_time_interval": train_time_interval}
        given = {k: v for k, v in triggers.items() if v is not None}
        first = dict(list(given.items())[:1])
        dirpath = _store.local_path(dirpath) if dirpath is not None else None  # file:// is the local disk
        super().__init__(dirpath=dirpath, filename=filename, monitor=monitor, verbose=verbose,  # type: ignore[call-arg]
                         save_last=save_last, save_top_k=save_top_k, save_on_exception=save_on_exception,
                         save_weights_only=save_weights_only or not include_optimizer_state, mode=mode,
                         auto_insert_metric_name=auto_insert_metric_name, save_on_train_epoch_end=save_on_train_epoch_end,
                         enable_version_counter=enable_version_counter, **first)
        if len(given) > 1:
            self._every_n_train_steps = every_n_train_steps or 0
            self._every_n_epochs = every_n_epochs or 0
            self._train_time_interval = train_time_interval
        self.include_optimizer_state = include_optimizer_state
        self.keep_newest = keep_newest
        self.async_save = async_save
        self.external_data = external_data
        self.ort_compatible = ort_compatible
        self.share_frozen = share_frozen
        self.export_best_to = export_best_to
        self.export_tolerance = export_tolerance
        self.storage_options = storage_options
        self.export_report: Any = None
        self.current_score_step: int | None = None
        self._saved: list[str] = []  # files saved for top-k or periodically, oldest first
        self._to_delete: set[str] = set()  # files waiting until nothing protects them
        self._last_unranked = ""
        self._saving_last = False  # inside _save_last_checkpoint: the file saved is the last file, whatever its name
        self._waiting_step: int | None = None  # a scheduled save waiting for the value computed at this step
        self._restored_monitor = False  # the value came with the checkpoint: stale until this run computes one
        self._link_target: str | None = None  # what last.ckpt points to once queued work is done
        self._in_batch_end = False
        self._found_last: str | None = None  # what ckpt_path="last" resolved to in this fit: rotates as usual
        self._resume_rng: tuple[Any, Any] = (None, None)  # random states and epoch of the checkpoint resumed from
        self._monitor_value: Any = None
        self._monitor_step: int | None = None
        self._io: OrtCheckpointIOMixin | None = None

    # -- set-up -------------------------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        ns = namespace_of(trainer)
        if not isinstance(self, ns.attr("callbacks.Callback")):  # the Trainer would add its own ModelCheckpoint
            right = "lightning_ort_ckpt.lightning" if ns.trainer.__name__ == "lightning.pytorch" else "lightning_ort_ckpt"
            raise CheckpointError(f"this OrtCheckpoint is for the other copy of Lightning than the Trainer's "
                                  f"({ns.trainer.__name__}; pytorch_lightning and lightning.pytorch do not mix): use "
                                  f"OrtCheckpoint from {right}")
        if self.export_best_to is not None and stage == "fit":
            from .export import check_export_config

            check_export_config(pl_module, self.export_tolerance)
        remote_link = self.save_last == "link" and _store.is_remote(self.dirpath)  # type: ignore[attr-defined]
        if remote_link:  # ModelCheckpoint refuses links on a store; ours become copies (_link_checkpoint)
            self.save_last = True
        try:
            super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        finally:
            if remote_link:
                self.save_last = "link"
        io = _lightning_adapter.raw_checkpoint_io(trainer.strategy)
        if isinstance(io, OrtCheckpointIOMixin):
            self._io = io
            mine = (self.external_data, self.ort_compatible, self.async_save, self.share_frozen, self.storage_options)
            theirs = (io.external_data, io.ort_compatible, io.async_save, io.share_frozen, io.storage_options)
            if mine != ("auto", False, False, True, None) and mine != theirs:
                warnings.warn("the Trainer already has an OrtCheckpointIO; its external_data, ort_compatible, "
                              "async_save, share_frozen and storage_options apply, not those given to OrtCheckpoint",
                              CheckpointWarning, stacklevel=2)
        elif io is None or type(io) in {ns.fabric_attr("plugins.io.torch_io.TorchCheckpointIO") for ns in loaded()}:
            self._io = plugin_class_for(ns)(self.external_data, self.ort_compatible, self.async_save,
                                            share_frozen=self.share_frozen, storage_options=self.storage_options)
            trainer.strategy.checkpoint_io = self._io
        else:
            raise ValueError(f"OrtCheckpoint writes through OrtCheckpointIO, but this Trainer has the plugin "
                             f"{type(io).__name__}; remove it or pass OrtCheckpointIO")
        self._io.bind(trainer.strategy)
        if self._io.storage_options is not None and _store.is_remote(self.dirpath):  # type: ignore[attr-defined]
            _lightning_adapter.set_checkpoint_filesystem(self, self.dirpath, self._io.storage_options)  # type: ignore

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._resume_rng = (checkpoint.get(RNG_KEY), checkpoint.get("epoch"))
        states = checkpoint.get("callbacks")
        twin = "ModelCheckpoint" + self.state_key[len(type(self).__qualname__):]  # type: ignore[attr-defined]
        if isinstance(states, dict) and self.state_key not in states and twin in states:  # type: ignore[attr-defined]
            # a file of a ModelCheckpoint with the same monitor, mode and triggers: carry on with its ranking, as
            # ModelCheckpoint itself would (Lightning restores it next, by our key)
            states[self.state_key] = states[twin]  # type: ignore[attr-defined]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Random states once more for a checkpoint saved inside its epoch (at validation end, or mid-epoch).

        The plugin restores them when the file is read, which is exact for a save at the end of a training epoch.
        A resume inside the saved epoch first draws a DataLoader iterator that finishes that epoch (Lightning's
        ``FitLoop.setup_data``); the uninterrupted run drew it before the save. Restoring again here undoes that.
        """
        (states, epoch), self._resume_rng = self._resume_rng, (None, None)
        if states is not None and trainer.current_epoch == epoch:
            _rng.restore(states)
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._found_last = None
        if self._io is not None:
            self._io.wait()  # every file durable and every error raised before fit returns
        if stage == "fit" and self.export_best_to is not None and trainer.is_global_zero:
            self._export_best(type(pl_module))
        super().teardown(trainer, pl_module, stage)  # type: ignore[misc]

    def _export_best(self, module_class: type) -> None:
        """``export_best_to``: the best checkpoint (else the last) as an ONNX model verified against ORT."""
        from .export import export_onnx

        source = self.best_model_path or self.last_model_path
        if not source:
            warnings.warn("export_best_to is set but no checkpoint was saved; nothing exported", CheckpointWarning)
            return
        self.export_report = export_onnx(module_class, source, self.export_best_to, tolerance=self.export_tolerance)

    # -- freshness of the monitored metric ----------------------------------------------------------------------
    def _note_monitor(self, trainer: Any) -> None:
        """Remember the step at which the monitored value last changed (Lightning replaces the tensor object)."""
        if self.monitor is None:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None and value is not self._monitor_value:
            self._monitor_value, self._monitor_step = value, trainer.global_step
            self._restored_monitor = False
            self._waiting_step = None  # a save waiting for this value is ranked by the hook that saves it

    def _fresh(self, trainer: Any) -> bool:
        return self._monitor_step == trainer.global_step and not self._restored_monitor

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._note_monitor(trainer)
        self._in_batch_end = True
        try:
            super().on_train_batch_end(trainer, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._in_batch_end = False

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._note_monitor(trainer)
        super().on_train_epoch_end(trainer, pl_module)  # type: ignore[misc]
        self._after_fresh_value(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._note_monitor(trainer)
        super().on_validation_end(trainer, pl_module)  # type: ignore[misc]
        if not self._epoch_end_follows(trainer):
            self._after_fresh_value(trainer)

    def _epoch_end_follows(self, trainer: Any) -> bool:
        """Whether this validation closes the training epoch and ModelCheckpoint saves at its end: the value is
        then ranked there (``on_train_epoch_end``), so that the file holds the loop state ModelCheckpoint's would,
        and a resume neither runs that epoch's end again nor saves it twice."""
        return bool(self._should_save_on_train_epoch_end(trainer)  # type: ignore[attr-defined]
                    and getattr(trainer.fit_loop.epoch_loop.batch_progress, "is_last_batch", False))

    def _after_fresh_value(self, trainer: Any) -> None:
        """Monitoring is a trigger of its own: a fresh value is ranked now (saved if it enters the top k), and a
        scheduled save that waited for it happens with it."""
        if self.monitor is None or not self._fresh(trainer):
            return
        self._waiting_step = None
        if self._should_skip_saving_checkpoint(trainer):  # type: ignore[attr-defined]  # saved at this step already
            return
        candidates = self._monitor_candidates(trainer)  # type: ignore[attr-defined]
        if self.monitor in candidates:
            self._save_topk_checkpoint(trainer, candidates)
            if self._last_global_step_saved == trainer.global_step:  # type: ignore[attr-defined]
                self._save_last_checkpoint(trainer, candidates)  # type: ignore[attr-defined]

    def _monitor_candidates(self, trainer: Any) -> dict[str, Any]:
        """Lightning's metrics; after a resume, the monitored value the run had when it was saved (stale), until
        validation computes it again, so that scheduled saves happen as in the uninterrupted run."""
        candidates = super()._monitor_candidates(trainer)  # type: ignore[misc]
        if self.monitor is not None and self.monitor not in candidates and self._monitor_value is not None:
            candidates[self.monitor] = self._monitor_value
        return candidates

    def _save_topk_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        """Lightning's top-k save, called by every trigger. A fresh monitored value is ranked as ModelCheckpoint
        ranks it; a stale one is never ranked: the scheduled save is written unranked, or waits for the value when
        validation computes it right after, at this same step."""
        if self.monitor is None or self.monitor not in monitor_candidates or self.save_top_k == 0:
            super()._save_topk_checkpoint(trainer, monitor_candidates)  # type: ignore[misc]
        elif self._fresh(trainer):
            if self.check_monitor_top_k(trainer, monitor_candidates[self.monitor]):  # type: ignore[attr-defined]
                self.current_score_step = trainer.global_step
            super()._save_topk_checkpoint(trainer, monitor_candidates)  # type: ignore[misc]
        elif self._in_batch_end and self._validation_follows(trainer):
            self._waiting_step = trainer.global_step
        else:
            self._save_unranked(trainer, monitor_candidates)

    def _save_unranked(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        filepath = self._get_metric_interpolated_filepath_name(monitor_candidates, trainer)  # type: ignore[attr-defined]
        previous, self._last_unranked = self._last_unranked, filepath  # set first: it is part of the file's state
        self._save_checkpoint(trainer, filepath)
        if self.keep_newest is None and previous and previous != filepath:  # one unranked file at a time
            self._to_delete.add(previous)
        self._retain(trainer)

    def _save_last_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        if self._waiting_step == trainer.global_step:
            return  # saved together with the file that waits for this step's value
        self._saving_last = True
        try:
            super()._save_last_checkpoint(trainer, monitor_candidates)  # type: ignore[misc]
        finally:
            self._saving_last = False
        self._retain(trainer)  # a file kept only because "last" linked to it can go now

    @staticmethod
    def _validation_follows(trainer: Any) -> bool:
        """Whether validation runs right after this training batch, at this same step.

        Asks the epoch loop's own test (Lightning calls it right after this hook; it reads the batch index and
        whether this is the last batch, both already final here). Validation by elapsed time is judged a moment
        early, so a save may then be written unranked just before a value it could have waited for.
        """
        batches = trainer.num_val_batches
        if not (sum(batches) if isinstance(batches, list) else batches):
            return False
        loop = trainer.fit_loop
        follows = _lightning_adapter.validation_follows(trainer)
        if follows is None:  # another Lightning version: ModelCheckpoint's own rule, the epoch's last batch
            every = trainer.check_val_every_n_epoch
            return bool(getattr(loop.epoch_loop.batch_progress, "is_last_batch", False)) and (
                every is None or (trainer.current_epoch + 1) % every == 0)
        return follows

    # -- saving, retention, links -------------------------------------------------------------------------------
    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        if self._saving_last:  # the last file (any CHECKPOINT_NAME_LAST template) is not one of the newest N
            super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]
            return
        # recorded before the save, as Lightning sets best_model_path first: the file's own state lists it, so a
        # run resumed from it (or from a link to it) can still rotate it out
        if filepath in self._saved:
            self._saved.remove(filepath)
        self._saved.append(filepath)
        self._to_delete.discard(filepath)
        super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]
        if self.keep_newest is not None:
            self._retain(trainer)

    def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
        """Lightning drops a file from its top k (or replaces last): delete it once nothing else keeps it."""
        self._to_delete.add(filepath)
        self._retain(trainer)

    def _retain(self, trainer: Any) -> None:
        keep = set(self.best_k_models) | {self.best_model_path, self.last_model_path}  # type: ignore[attr-defined]
        if self._link_target is None and self.last_model_path and os.path.islink(self.last_model_path):
            self._link_target = os.path.join(os.path.dirname(self.last_model_path), os.readlink(self.last_model_path))
        if self._link_target:  # never leave "last" dangling: its target goes only once the link has moved on
            keep.add(self._link_target)
        resumed = os.fspath(trainer.ckpt_path) if trainer.ckpt_path else None
        if resumed and _absolute(resumed) != self._found_last:  # a file the user chose: never deleted
            keep.add(resumed)
        if self.keep_newest is not None:
            keep.update(self._saved[-self.keep_newest:])
            self._to_delete.update(self._saved[:-self.keep_newest])
        for path in sorted(self._to_delete - keep):
            if self._should_remove_checkpoint(trainer, path, self.last_model_path or ""):
                trainer.strategy.remove_checkpoint(path)
            self._to_delete.discard(path)
            if path in self._saved:
                self._saved.remove(path)

    def _should_remove_checkpoint(self, trainer: Any, previous: str, current: str) -> bool:
        """Lightning's test (not the current file, inside ``dirpath``, not the file resumed from), with ``..`` and
        links resolved first (:meth:`_confined`). The file ``ckpt_path="last"`` resolved to is one of ours and
        rotates as in the uninterrupted run; a file the user named (a path, or ``"best"``) stays."""
        if not self._confined(previous):
            return False
        if _absolute(previous) == self._found_last:
            return _absolute(previous) != _absolute(current)
        return bool(super()._should_remove_checkpoint(trainer, previous, current))  # type: ignore[misc]

    def _confined(self, path: str) -> bool:
        """Whether this callback may delete ``path`` or make a link there or to it: a visible ``*.ckpt`` name in
        ``dirpath`` or a folder below it, after ``..`` and symbolic links in its folders are resolved (the name
        itself is unlinked, never followed). Paths restored from a file's callback state are trusted no further."""
        name = os.path.basename(path)
        if not self.dirpath or name.startswith(".") or not name.endswith(self.FILE_EXTENSION):  # type: ignore[attr-defined]
            return False
        if _store.is_remote(self.dirpath) or _store.is_remote(path):  # a store has no links: names are all
            root, folder = posixpath.normpath(self.dirpath), posixpath.normpath(posixpath.dirname(path))
            return _store.is_remote(path) and (folder == root or folder.startswith(root.rstrip("/") + "/"))
        root = os.path.realpath(self.dirpath)
        folder = os.path.realpath(os.path.dirname(path) or os.curdir)
        return folder == root or folder.startswith(root.rstrip(os.sep) + os.sep)

    def _link_checkpoint(self, trainer: Any, filepath: str, linkpath: str) -> None:  # type: ignore[override]
        """save_last="link": a relative symlink (and one for ``.data``), made once ``filepath`` is durable; on a store
        without links, a copy, independent of ``filepath`` from then on."""
        if not (self._confined(filepath) and self._confined(linkpath)):
            raise CheckpointError(f"save_last='link' links only checkpoints inside dirpath {self.dirpath!r}; "
                                  f"refusing to link {linkpath!r} to {filepath!r}", linkpath)
        if trainer.is_global_zero and _absolute(filepath) != _absolute(linkpath):
            assert self._io is not None
            self._io.link(filepath, linkpath)  # queued behind the save of filepath when saving asynchronously
            self._link_target = None if _store.is_remote(linkpath) else filepath
        trainer.strategy.barrier()

    # -- resume -------------------------------------------------------------------------------------------------
    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """For ``ckpt_path="last"``: the newest checkpoint in ``dirpath`` that can resume a fit, skipping damaged and
        weights-only files (and sub-folders only where ``filename`` makes them, with a "/")."""
        directory = _lightning_adapter.resolve_ckpt_dir(self, trainer)  # as Lightning does
        nested = "/" in (self.filename or "") + self.CHECKPOINT_NAME_LAST  # type: ignore[attr-defined]
        lasts = super()._find_last_checkpoints(trainer)  # type: ignore[misc]
        if _store.is_remote(directory):  # ModelCheckpoint's search drops the URL's protocol: put it back
            candidates = {p for p in _store.list_files(directory, nested, self._storage_options())
                          if p.endswith(self.FILE_EXTENSION)}  # type: ignore[attr-defined]
            lasts = {p for p in candidates if os.path.normpath(_store.strip_protocol(p)) in lasts}
        else:
            candidates = set(lasts)
        if directory and not _store.is_remote(directory) and os.path.isdir(directory):
            for folder, subfolders, files in os.walk(directory):
                subfolders[:] = sorted(d for d in subfolders if nested and not d.startswith("."))
                candidates |= {os.path.join(folder, f) for f in files
                               if f.endswith(self.FILE_EXTENSION) and not f.startswith(".")}  # type: ignore[attr-defined]
        # newest first; on a tie (a link and its target) the link, then Lightning's own last* names
        options = self._storage_options()
        newest_first = sorted(candidates, key=lambda p: (_store.modified(p, options), os.path.islink(p), p in lasts),
                              reverse=True)
        for path in newest_first:
            try:
                with _store.fetched(path, options) as local:  # a file of a store is downloaded once for both
                    problem = _unreadable(local) or _weights_only(local)
            except CheckpointError as e:
                problem = str(e).removeprefix(f"{path}: ")
            if problem is None:
                self._found_last = _absolute(path)
                return {path}
            warnings.warn(f"{path} cannot be resumed from ({problem}); trying the next newest checkpoint",
                          CheckpointWarning, stacklevel=2)
        return set()

    def _storage_options(self) -> StorageOptions | None:
        """The options the files are written with: the plugin's (they may come from the Trainer's plugin)."""
        return self._io.storage_options if self._io is not None else self.storage_options

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "current_score_step": self.current_score_step,  # type: ignore[misc]
                "saved": list(self._saved), "last_unranked": self._last_unranked,
                "monitor_value": self._monitor_value, "monitor_step": self._monitor_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self.current_score_step = state_dict.get("current_score_step")
        self._monitor_value, self._monitor_step = state_dict.get("monitor_value"), state_dict.get("monitor_step")
        self._restored_monitor = self._monitor_value is not None
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:  # only our own files, and never trusted beyond
            self._saved = [p for p in state_dict.get("saved", [])
                           if self._confined(p) and _store.exists(p, self._storage_options())]
            unranked = state_dict.get("last_unranked", "")
            self._last_unranked = unranked if self._confined(unranked) else ""
            named = [*self.best_k_models, self.kth_best_model_path, self.best_model_path,  # type: ignore[attr-defined]
                     self.last_model_path, *state_dict.get("saved", []), unranked]  # type: ignore[attr-defined]
            outside = sorted({p for p in named if p and not self._confined(p)})
            if outside:
                warnings.warn(f"the checkpoint's callback state names files that are not checkpoints inside dirpath "
                              f"{self.dirpath!r}: {', '.join(outside)}; they will never be deleted or linked",
                              CheckpointWarning, stacklevel=2)


def _absolute(path: str) -> str:
    """The absolute form of a local path; a URL as it is."""
    return path if _store.is_remote(path) else os.path.abspath(path)


def _unreadable(path: str) -> str | None:
    """Why ``path`` cannot be resumed from, or None: the full read a resume does, with every tensor checked against
    its checksum and the Lightning metadata decoded. A torch file must load with ``weights_only=True``."""
    import torch  # loaded with Lightning by now

    if not os.path.exists(path):
        return "missing"
    try:
        with warnings.catch_warnings():  # what the resume itself will say, said once
            warnings.simplefilter("ignore")
            if not is_ort_checkpoint(path):
                load_torch_file(torch.load, path, "cpu", True)
                return None
            ck = load_checkpoint(path)
            if MANIFEST in ck.properties:
                from_ort(ck, path)
        return None
    except CheckpointError as e:
        return str(e).removeprefix(f"{path}: ")


def _weights_only(path: str) -> str | None:
    """"weights only" when ``path`` (readable) holds no optimizer state, so a fit cannot resume from it: for our
    files, by the Lightning keys their manifest lists; for torch zip files, by the key's name in the pickle's bytes
    (read, never unpickled). Files ORT wrote alone, and other files, are taken on trust."""
    if is_ort_checkpoint(path):
        try:
            with open_checkpoint(path) as reader:
                manifest = reader.properties.get(MANIFEST)
        except CheckpointError as e:
            return str(e).removeprefix(f"{path}: ")
        if not isinstance(manifest, str):
            return None  # written by ORT alone: the plugin builds its optimizer state
        try:
            keys = json.loads(manifest).get("keys", [])
        except (ValueError, AttributeError):
            return "its Lightning metadata is damaged"
        return None if "optimizer_states" in keys else "weights only"
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if pickles and all(b"optimizer_states" not in archive.read(n) for n in pickles):
                return "weights only"
    except (OSError, zipfile.BadZipFile, KeyError, RuntimeError):
        pass  # not a zip (an older torch file): Lightning will tell
    return None


class OrtCheckpoint(OrtCheckpointMixin, ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` writing ORT checkpoints, for ``pytorch_lightning`` Trainers (module doc)."""
