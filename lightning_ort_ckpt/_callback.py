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
  all (``format._store``), listed and deleted on the store; ``save_last="link"``, which ModelCheckpoint refuses
  there, becomes a copy. A ``file://`` URL is the local path it names (ModelCheckpoint makes a folder ``file:``).
- **"last" falls back**: ``ckpt_path="last"`` resumes from the newest checkpoint in ``dirpath`` that can resume a
  fit, skipping (with a warning) unreadable and weights-only files.
- **Several ranks and nodes**: ``setup`` checks that every rank sees ``dirpath`` (a node-local disk under
  ``num_nodes > 1`` is a clear error on every rank, within seconds) and that every rank resumes from the checkpoint
  rank 0 resolved ``"last"`` to (rank 0 alone reads the candidates); every rank calls the same collectives.
- **Checkpoint folders** (sharded checkpoints) are one checkpoint each for "last" and retention; one whose save did
  not finish is skipped, and deleted after the next save.
- **Exact resume from any save point**: the random states are applied again at ``on_train_start`` when a checkpoint
  saved inside its epoch (at validation end, or mid-epoch) resumes, which the plugin alone cannot do.
- ``include_optimizer_state=False`` writes parameters only (small deploy files), like ORT's flag of that name; it is
  ``save_weights_only=True`` under the ORT name.
- ``export_best_to="model.onnx"`` exports the best checkpoint (the last one without ``monitor``) when fit ends, as
  an ONNX inference model verified against ONNX Runtime (see ``lightning_ort_ckpt.export``); the report is in
  ``export_report``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import warnings
from datetime import timedelta
from typing import Any, ClassVar, Literal

from pytorch_lightning.callbacks import ModelCheckpoint

from . import _lightning_adapter, _loggers
from ._namespaces import loaded, namespace_of
from ._plugin import OrtCheckpointIO, OrtCheckpointIOMixin
from ._binding import bound_plugin
from ._dcp_storage import METADATA_NAME, is_sharded_checkpoint, join
from ._reading import is_ort_checkpoint, read_contents, to_lightning
from ._translation import MANIFEST
from ._retention import retain
from ._torch_files import load_torch_file
from .errors import CheckpointConfigError, CheckpointError, CheckpointSaveError, CheckpointWarning
from .format import CheckpointContents
from .format._shared_data import damage_note
from .format._store import StorageOptions, Store, is_remote, local_path, store_for, strip_protocol
from .format._writer import ExternalData

_MARKER_PREFIX = ".ort_ckpt.shared."  # the file rank 0 writes in dirpath at setup, for every rank to find


class OrtCheckpointMixin:
    """The behaviour of ``OrtCheckpoint``, shared by the ``pytorch_lightning`` and ``lightning.pytorch`` classes."""

    plugin_class: ClassVar[type[OrtCheckpointIOMixin]] = OrtCheckpointIO
    """The ``OrtCheckpointIO`` class of this callback's copy of Lightning."""

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
        include_optimizer_state: bool | None = None,
        keep_newest: int | None = None,
        checkpoint_io: OrtCheckpointIOMixin | None = None,
        async_save: bool | None = None,
        external_data: ExternalData | None = None,
        ort_compatible: bool | None = None,
        share_frozen: bool | Literal["trusted"] | None = None,
        storage_options: StorageOptions | None = None,
        export_best_to: str | os.PathLike[str] | None = None,
        export_tolerance: float = 1e-5,
    ) -> None:
        """Every argument before ``*`` is ``ModelCheckpoint``'s, with its meaning (docs/callback.md lists where we
        differ on purpose); the ones after it are ours.

        Args:
            include_optimizer_state: ORT's name for ``not save_weights_only`` (one setting: giving both, in
                contradiction, is an error). False writes parameters only: small files to deploy, which cannot
                resume a fit.
            keep_newest: keep the newest N files saved (ORT's ``max_num_checkpoints``), next to the top k by metric.
            checkpoint_io: the ``OrtCheckpointIO`` to write through, with its settings; installed on the Trainer in
                ``setup``. Without it, one is built from the five settings below (``OrtCheckpointIO``'s arguments,
                with its defaults), or the Trainer's own ``OrtCheckpointIO`` is used when it has one and none of
                them is given.
            async_save, external_data, ort_compatible, share_frozen, storage_options: ``OrtCheckpointIO``'s
                arguments, for the plugin built here; not together with ``checkpoint_io``.
            export_best_to: when fit ends, export the best checkpoint (the last one without ``monitor``) to this path
                as an ONNX model verified against ONNX Runtime (``lightning_ort_ckpt.export``); the report is in
                ``export_report``.
            export_tolerance: the largest difference between ONNX Runtime's and torch's outputs that export accepts.

        Raises:
            CheckpointConfigError: an argument, or a combination of them, is invalid.
        """
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and value < 0:
                raise CheckpointConfigError(f"{name} must be >= 0, got {value}")
        if keep_newest is not None and keep_newest < 1:
            raise CheckpointConfigError(f"keep_newest must be None or >= 1, got {keep_newest}")
        if include_optimizer_state and save_weights_only:
            raise CheckpointConfigError("include_optimizer_state=True contradicts save_weights_only=True: they are one "
                                        "setting (include_optimizer_state=False is save_weights_only=True); give one")
        settings = {k: v for k, v in (("external_data", external_data), ("ort_compatible", ort_compatible),
                                      ("async_save", async_save), ("share_frozen", share_frozen),
                                      ("storage_options", storage_options)) if v is not None}
        if checkpoint_io is not None and settings:
            raise CheckpointConfigError(f"{', '.join(settings)} configure the plugin: pass them to the "
                                        "OrtCheckpointIO given as checkpoint_io, not to OrtCheckpoint")
        if checkpoint_io is not None and not isinstance(checkpoint_io, self.plugin_class):
            raise CheckpointConfigError(f"checkpoint_io must be a {self.plugin_class.__module__}."
                                        f"{self.plugin_class.__qualname__}, got {type(checkpoint_io).__name__}")
        if keep_newest is not None and monitor is None and save_top_k == 1:
            save_top_k = -1  # without a metric, keep_newest alone decides which files go
        # ModelCheckpoint accepts one trigger; give it the first and set the others afterwards (they are checked
        # independently in its hooks).
        triggers = {"every_n_train_steps": every_n_train_steps, "every_n_epochs": every_n_epochs,
                    "train_time_interval": train_time_interval}
        given = {k: v for k, v in triggers.items() if v is not None}
        first = dict(list(given.items())[:1])
        dirpath = local_path(dirpath) if dirpath is not None else None  # file:// is the local disk
        super().__init__(dirpath=dirpath, filename=filename, monitor=monitor, verbose=verbose,  # type: ignore[call-arg]
                         save_last=save_last, save_top_k=save_top_k, save_on_exception=save_on_exception,
                         save_weights_only=save_weights_only or include_optimizer_state is False, mode=mode,
                         auto_insert_metric_name=auto_insert_metric_name, save_on_train_epoch_end=save_on_train_epoch_end,
                         enable_version_counter=enable_version_counter, **first)
        if len(given) > 1:
            self._every_n_train_steps = every_n_train_steps or 0
            self._every_n_epochs = every_n_epochs or 0
            self._train_time_interval = train_time_interval
        self.keep_newest = keep_newest
        self._own_io = checkpoint_io is not None or bool(settings)  # chosen here: the Trainer's may not replace it
        self.checkpoint_io: OrtCheckpointIOMixin = checkpoint_io or self.plugin_class(**settings)
        self.export_best_to = export_best_to
        self.export_tolerance = export_tolerance
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
        self._last_choice: tuple[bool, str | None, bool] = (False, None, False)  # "last" asked; found; a folder
        self._monitor_value: Any = None
        self._monitor_step: int | None = None

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
        remote_link = self.save_last == "link" and is_remote(self.dirpath)  # type: ignore[attr-defined]
        if remote_link:  # ModelCheckpoint refuses links on a store; ours become copies (_link_checkpoint)
            self.save_last = True
        try:
            super().setup(trainer, pl_module, stage)  # type: ignore[misc]
        finally:
            if remote_link:
                self.save_last = "link"
        io = _lightning_adapter.raw_checkpoint_io(trainer.strategy)
        if isinstance(io, OrtCheckpointIOMixin) and io is not self.checkpoint_io:
            if self._own_io:
                raise CheckpointConfigError(
                    "the Trainer already has an OrtCheckpointIO, and OrtCheckpoint was given plugin settings (or "
                    "checkpoint_io) of its own: configure one plugin, either in Trainer(plugins=...) or here")
            self.checkpoint_io = io  # the Trainer's plugin, with its settings
        elif io is None or type(io) in {ns.fabric_attr("plugins.io.torch_io.TorchCheckpointIO") for ns in loaded()}:
            trainer.strategy.checkpoint_io = self.checkpoint_io
        elif io is not self.checkpoint_io:
            raise CheckpointConfigError(f"OrtCheckpoint writes through OrtCheckpointIO, but this Trainer has the "
                                        f"plugin {type(io).__name__}; remove it or pass OrtCheckpointIO")
        self.checkpoint_io.bind(trainer.strategy)
        dirpath = self.dirpath  # type: ignore[attr-defined]  # rank 0's, on every rank (ModelCheckpoint's setup)
        if self.checkpoint_io.storage_options is not None and is_remote(dirpath):
            _lightning_adapter.set_checkpoint_filesystem(self, dirpath, self.checkpoint_io.storage_options)
        self._check_dirpath(trainer, stage)
        _loggers.check_loggers(trainer)

    def _check_dirpath(self, trainer: Any, stage: str) -> None:
        """``dirpath`` must be a directory, and, with several ranks, the same one for each: rank 0 writes a marker
        file there (when fitting) and every rank must see it; the "last" checkpoint rank 0 resolved must be the one
        each rank resumes from (:meth:`_adopt_last`). Every rank calls the same two collectives here, whatever it
        finds, and every rank raises the same error: a rank that raised alone would leave the others waiting in the
        next collective until the process group times out."""
        dirpath = self.dirpath  # type: ignore[attr-defined]
        problem = None
        if dirpath is not None and not is_remote(dirpath) and os.path.exists(dirpath) and not os.path.isdir(dirpath):
            problem = f"dirpath {dirpath!r} is a file, not a directory"
        if trainer.world_size == 1:
            if problem is not None:
                raise CheckpointConfigError(problem)
            return
        import torch  # loaded with Lightning by now

        strategy = trainer.strategy
        marker = token = None
        if trainer.is_global_zero and problem is None and stage == "fit" and dirpath is not None:
            token = secrets.token_hex(16)
            marker = join(dirpath, f"{_MARKER_PREFIX}{token}")
            try:
                with self._store(marker).writing(marker, with_data=False, required_bytes=len(token)) as files:
                    files.main.write(token.encode())
            except (CheckpointError, OSError) as e:
                problem, marker = f"rank 0 cannot write in dirpath {dirpath!r} ({e})", None
        marker, token, problem, last = strategy.broadcast((marker, token, problem, self._last_choice), src=0)
        seen = marker is None or self._store(marker).read_head(marker, len(token)) == token.encode()
        agrees = self._adopt_last(trainer, last)
        flags = strategy.all_gather(torch.tensor([int(seen), int(agrees), trainer.node_rank],
                                                 device=strategy.root_device)).reshape(-1, 3).tolist()
        if marker is not None and trainer.is_global_zero:
            with contextlib.suppress(CheckpointError, OSError):
                self._store(marker).remove(marker)
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
            mine = "" if trainer.global_rank not in astray else f" (this rank: {self._last_choice[1] or 'none'})"
            raise CheckpointConfigError(
                f'ckpt_path="last": global rank 0 resolved it to {(last[1] if last else None) or "no checkpoint"} in '
                f"dirpath {dirpath!r}, but global rank(s) {', '.join(map(str, astray))} found another{mine} and "
                "cannot load rank 0's: is dirpath a directory every node shares?")

    @property
    def include_optimizer_state(self) -> bool:
        """ORT's name for ``not save_weights_only``."""
        return not self.save_weights_only  # type: ignore[attr-defined]

    def _store(self, path: str | None = None) -> Store:
        """The store of ``path`` (``dirpath`` by default), with the plugin's options."""
        return store_for(path if path is not None else self.dirpath,  # type: ignore[attr-defined]
                         self.checkpoint_io.storage_options)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("callbacks")
        twin = "ModelCheckpoint" + self.state_key[len(type(self).__qualname__):]  # type: ignore[attr-defined]
        if isinstance(states, dict) and self.state_key not in states and twin in states:  # type: ignore[attr-defined]
            # a file of a ModelCheckpoint with the same monitor, mode and triggers: carry on with its ranking, as
            # ModelCheckpoint itself would (Lightning restores it next, by our key)
            states[self.state_key] = states[twin]  # type: ignore[attr-defined]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """The random states of the checkpoint resumed from, where the uninterrupted run had them (see
        ``OrtCheckpointIOMixin.restore_random_states``)."""
        self.checkpoint_io.restore_random_states(trainer)
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._found_last, self._last_choice = None, (False, None, False)
        self.checkpoint_io.wait()  # every file durable and every error raised before fit returns
        if stage == "fit" and self.export_best_to is not None and trainer.is_global_zero:
            self._export_best(pl_module)
        _loggers.log_whole_units(trainer, self, finishing=True)  # what loggers log at finalize, after teardown
        super().teardown(trainer, pl_module, stage)  # type: ignore[misc]

    def _export_best(self, module: Any) -> None:
        """``export_best_to``: the best checkpoint (else the last) as an ONNX model verified against ORT, after the
        module rebuilt from it is checked against the trained one (``module``)."""
        from .export import export_onnx

        source = self.best_model_path or self.last_model_path
        if not source:
            warnings.warn("export_best_to is set but no checkpoint was saved; nothing exported", CheckpointWarning)
            return
        self.export_report = export_onnx(type(module), source, self.export_best_to, tolerance=self.export_tolerance,
                                         reference=module)

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

    def _builtin_monitor(self, trainer: Any) -> bool:
        """``monitor="step"`` or ``"epoch"`` without a logged metric of that name: Lightning's own candidates,
        computed at every save (its documented "keep the latest k" recipe)."""
        return self.monitor in ("step", "epoch") and self.monitor not in trainer.callback_metrics

    def _fresh(self, trainer: Any) -> bool:
        if self._builtin_monitor(trainer):
            return True
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
        if self.monitor is None or self._builtin_monitor(trainer) or not self._fresh(trainer):
            return  # (a step or epoch count is no value that improves: the scheduled triggers save it)
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
            _loggers.log_whole_units(trainer, self)  # the .data (or folder) beside what the loggers just logged
            return
        # recorded before the save, as Lightning sets best_model_path first: the file's own state lists it, so a
        # run resumed from it (or from a link to it) can still rotate it out
        if filepath in self._saved:
            self._saved.remove(filepath)
        self._saved.append(filepath)
        self._to_delete.discard(filepath)
        super()._save_checkpoint(trainer, filepath)  # type: ignore[misc]
        _loggers.log_whole_units(trainer, self)
        if self.keep_newest is not None or self._to_delete:  # (a half-written folder "last" skipped waits too)
            self._retain(trainer)

    def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
        """Lightning drops a file from its top k (or replaces last): delete it once nothing else keeps it."""
        self._to_delete.add(filepath)
        self._retain(trainer)

    def _retain(self, trainer: Any) -> None:
        keep = set(self.best_k_models) | {self.best_model_path, self.last_model_path}  # type: ignore[attr-defined]
        if self._link_target is None and self.last_model_path:
            self._link_target = self._store(self.last_model_path).link_target(self.last_model_path)
        if self._link_target:  # never leave "last" dangling: its target goes only once the link has moved on
            keep.add(self._link_target)
        resumed = os.fspath(trainer.ckpt_path) if trainer.ckpt_path else None
        if resumed and _absolute(resumed) != self._found_last:  # a file the user chose: never deleted
            keep.add(resumed)
        delete, self._to_delete = retain(self._saved, self._to_delete, keep, self.keep_newest)
        for path in delete:
            if self._should_remove_checkpoint(trainer, path, self.last_model_path or ""):
                trainer.strategy.remove_checkpoint(path)
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
        if is_remote(self.dirpath) != is_remote(path):  # type: ignore[attr-defined]
            return False
        return self._store(path).contains(self.dirpath, path)  # type: ignore[attr-defined]

    def _link_checkpoint(self, trainer: Any, filepath: str, linkpath: str) -> None:  # type: ignore[override]
        """save_last="link": a relative symlink (and one for ``.data``), made once ``filepath`` is durable; on a store
        without links, a copy, independent of ``filepath`` from then on."""
        error: Exception | None = None
        if not (self._confined(filepath) and self._confined(linkpath)):
            error = CheckpointError(f"save_last='link' links only checkpoints inside dirpath {self.dirpath!r}; "
                                    f"refusing to link {linkpath!r} to {filepath!r}", linkpath)
        elif trainer.is_global_zero and _absolute(filepath) != _absolute(linkpath):
            try:
                self.checkpoint_io.link(filepath, linkpath)  # queued behind the save of filepath when asynchronous
                self._link_target = None if is_remote(linkpath) else filepath
            except CheckpointError as e:
                error = e
            except OSError as e:
                error = CheckpointSaveError(f"cannot link it to {filepath!r} ({e.strerror or e})", linkpath)
        # ModelCheckpoint's barrier, carrying whether the link was made: every rank raises, or none (one that raised
        # alone would leave the others waiting in the next collective)
        if not trainer.strategy.reduce_boolean_decision(error is None, all=True) and error is None:
            error = CheckpointSaveError(f"global rank 0 could not link it to {filepath!r} (its error says why)",
                                        linkpath)
        if error is not None:
            raise error

    # -- resume -------------------------------------------------------------------------------------------------
    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """For ``ckpt_path="last"``: the newest checkpoint in ``dirpath`` that can resume a fit, skipping damaged and
        weights-only files and half-written checkpoint folders (and sub-folders only where ``filename`` makes them,
        with a "/"). A committed checkpoint folder (a sharded checkpoint) is one checkpoint; one without its
        metadata (a save that did not finish) is skipped, and deleted after the next save.

        Rank 0 alone reads the candidates (each once, in full, checksums verified). Lightning asks before the
        process group is up, so the other ranks take the newest candidate by the listing alone, and ``setup``
        has every rank load the one rank 0 chose (:meth:`_adopt_last`)."""
        directory = _lightning_adapter.resolve_ckpt_dir(self, trainer)  # as Lightning does
        nested = "/" in (self.filename or "") + self.CHECKPOINT_NAME_LAST  # type: ignore[attr-defined]
        lasts = super()._find_last_checkpoints(trainer)  # type: ignore[misc]
        store = self._store(directory)
        extension = self.FILE_EXTENSION  # type: ignore[attr-defined]
        files = store.list_files(directory, nested) if directory else []
        folders = {d for d in (store.list_folders(directory, nested) if directory else []) if d.endswith(extension)}
        if is_remote(directory):  # ModelCheckpoint's search drops the URL's protocol: put it back
            lasts = {p for p in [*files, *folders] if os.path.normpath(strip_protocol(p)) in lasts}
        candidates = {p for p in set(lasts) | folders | {f for f in files if f.endswith(extension)}
                      if not any(_inside(p, folder) for folder in folders)}  # a folder's own files are no candidates
        # newest first; on a tie (a link and its target) the link, then Lightning's own last* names, then by name
        newest_first = sorted(candidates, key=lambda p: (_modified(store, p, p in folders), store.link_target(p)
                                                         is not None, p in lasts, p), reverse=True)
        rank_zero = trainer.global_rank == 0
        half = {f for f in folders & candidates if not store.exists(join(f, METADATA_NAME))}
        if half and rank_zero:  # saves that did not finish: retention deletes them once the next save is stored
            self._to_delete.update(half)
            warnings.warn(f"{', '.join(sorted(half))}: checkpoint folder(s) without {METADATA_NAME} (a save that did "
                          "not finish): not resumed from, and deleted after the next save", CheckpointWarning,
                          stacklevel=2)
        io = bound_plugin(trainer) or self.checkpoint_io  # setup installs ours later, when the Trainer has none
        for path in newest_first:
            if path in half:
                continue
            if path in folders:
                if is_sharded_checkpoint(path, self.checkpoint_io.storage_options):
                    return self._chose_last(path, folder=True)
                if rank_zero:
                    warnings.warn(f"{path} cannot be resumed from (a checkpoint folder whose {METADATA_NAME} is "
                                  "damaged); trying the next newest checkpoint", CheckpointWarning, stacklevel=2)
                continue
            if not rank_zero:
                return self._chose_last(path, folder=False)
            try:
                found = _resumable(path, self.checkpoint_io.storage_options)
            except CheckpointError as e:
                why = str(e).removeprefix(f"{path}: ")
                note = damage_note(path, str(e))  # a shared .data: how many checkpoints it takes with it
                warnings.warn(f"{path} cannot be resumed from ({why}{'; ' + note if note else ''}); trying the next "
                              "newest checkpoint", CheckpointWarning, stacklevel=2)
                continue
            io.hold(path, found)
            return self._chose_last(path, folder=False)
        self._last_choice = (True, None, False)
        return set()

    def _chose_last(self, path: str, folder: bool) -> set[str]:
        self._last_choice = (True, path, folder)
        self._found_last = _absolute(path)
        return {path}

    def _adopt_last(self, trainer: Any, agreed: tuple[bool, str | None, bool]) -> bool:
        """Whether this rank resumes from the checkpoint rank 0 resolved ``ckpt_path="last"`` to (``agreed``, rank
        0's ``_last_choice``). Where this rank's listing chose another file (one rank 0 found damaged or weights
        only), the plugin is handed what rank 0's file holds (one read) for the load Lightning does of this rank's
        path; a folder, or no checkpoint on one side, cannot be handed over."""
        asked, mine, folder = self._last_choice
        if tuple(agreed) == self._last_choice:
            return True
        path = agreed[1]
        if not (asked and agreed[0] and mine and path) or folder or agreed[2]:
            return False
        try:
            found = _resumable(path, self.checkpoint_io.storage_options)
        except (CheckpointError, OSError):
            return False
        self.checkpoint_io.hold(mine, found)
        return True

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
                           if self._confined(p) and self._store(p).exists(p)]
            unranked = state_dict.get("last_unranked", "")
            self._last_unranked = unranked if self._confined(unranked) else ""
            named = [*self.best_k_models, self.kth_best_model_path, self.best_model_path,  # type: ignore[attr-defined]
                     self.last_model_path, *state_dict.get("saved", []), unranked]  # type: ignore[attr-defined]
            outside = sorted({p for p in named if p and not self._confined(p)})
            if outside:
                warnings.warn(f"the checkpoint's callback state names files that are not checkpoints inside dirpath "
                              f"{self.dirpath!r}: {', '.join(outside)}; they will never be deleted or linked",
                              CheckpointWarning, stacklevel=2)


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/") or path.startswith(folder.rstrip(os.sep) + os.sep)


def _modified(store: Store, path: str, folder: bool) -> float:
    """When ``path`` was written; for a checkpoint folder, when it was committed (its metadata), or, without
    metadata, when it last changed."""
    return max(store.modified(path), store.modified(join(path, METADATA_NAME))) if folder else store.modified(path)


def _absolute(path: str) -> str:
    """The absolute form of a local path; a URL as it is."""
    return path if is_remote(path) else os.path.abspath(path)


def _resumable(path: str, storage_options: StorageOptions | None) -> CheckpointContents | dict[str, Any]:
    """What ``path`` holds, read once in full (every tensor checked against its checksum, the Lightning metadata
    decoded: the plugin's load takes the decoded dict as it is), if a fit can resume from it; else our error saying
    why. A torch file must load with ``weights_only=True``. A file ORT wrote alone is held as its contents: the
    plugin builds its optimizer state from them and the live optimizers when it loads it."""
    with warnings.catch_warnings():  # what the resume itself will say, said once
        warnings.simplefilter("ignore")
        if not is_ort_checkpoint(path, storage_options):
            import torch  # loaded with Lightning by now

            with store_for(path, storage_options).fetched(path) as local:
                found: Any = load_torch_file(torch.load, local, "cpu", True)
        else:
            found = read_contents(path, storage_options)
            if MANIFEST not in found.properties:
                return found
            found = to_lightning(found, path)
    if not isinstance(found, dict) or "optimizer_states" not in found:
        raise CheckpointError("weights only", path)
    return found


class OrtCheckpoint(OrtCheckpointMixin, ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` writing ORT checkpoints, for ``pytorch_lightning`` Trainers (module doc)."""
