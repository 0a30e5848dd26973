"""``OrtWandbLogger``: Lightning's ``WandbLogger`` that logs each checkpoint whole.

``WandbLogger(log_model=...)`` logs one file per checkpoint (``artifact.add_file(path)``): a checkpoint with a
``.data`` (``external_data``, frozen sharing, past 2 GiB) reaches W&B without it, and a sharded checkpoint (a
folder) not at all; an artifact version takes no file once logged, so nothing can be added beside it afterwards
(``_loggers`` does that for MLflow). Users pass this subclass instead: it hands ``WandbLogger`` ``log_model=False``
(so the parent logs nothing) and logs, on the same occasions the parent would, one artifact per checkpoint holding
the file and its ``.data``, or the folder. Only public names are used: ``Logger.after_save_checkpoint`` and
``finalize``, ``WandbLogger.experiment``, ``wandb.Artifact``; nothing is wrapped.
"""

from __future__ import annotations

import os
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only
from pytorch_lightning.loggers import WandbLogger

from ._loggers import logged_checkpoints, unit_files, unit_time


class WholeCheckpointsMixin:
    """What ``OrtWandbLogger`` adds to its namespace's ``WandbLogger``: ``log_model`` (False, True or "all", as
    ``WandbLogger``'s) logs every checkpoint whole. ``checkpoint_artifacts``: checkpoint path -> the artifact last
    logged for it."""

    experiment: Any

    def __init__(self, *args: Any, log_model: bool | str = False, **kwargs: Any) -> None:
        if log_model not in (False, True, "all"):
            from ..errors import CheckpointConfigError

            raise CheckpointConfigError(f"log_model must be False, True or 'all', got {log_model!r}")
        super().__init__(*args, log_model=False, **kwargs)  # type: ignore[call-arg]  # the parent logs nothing
        self.whole_log_model = log_model
        self.checkpoint_artifacts: dict[str, Any] = {}
        self._callbacks: dict[int, Any] = {}
        self._logged_time: dict[str, float] = {}

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """As ``WandbLogger``: with ``"all"`` (or ``True`` and ``save_top_k=-1``) log the new checkpoints now, else at
        ``finalize``. "Now" is in order with the saves (an ``OrtCheckpoint``'s plugin runs it where its saves run:
        after the save just asked for is complete, before any later save or deletion, also with ``async_save``)."""
        self._callbacks[id(checkpoint_callback)] = checkpoint_callback
        mode = self.whole_log_model
        if mode == "all" or (mode is True and checkpoint_callback.save_top_k == -1):
            paths, best = logged_checkpoints(checkpoint_callback), checkpoint_callback.best_model_path
            in_order = getattr(getattr(checkpoint_callback, "checkpoint_io", None), "run_in_order", None)
            if in_order is not None:  # OrtCheckpoint: where its plugin's saves run
                in_order(self._log, checkpoint_callback, paths, best)
            else:
                self._log(checkpoint_callback, paths, best)

    def finalize(self, status: str) -> None:
        """At the end of a successful fit (after every save is durable), what was not logged yet, as it is now."""
        super().finalize(status)  # type: ignore[misc]
        if status == "success" and self.whole_log_model:
            for callback in self._callbacks.values():
                self._log(callback, logged_checkpoints(callback), callback.best_model_path)

    def _log(self, callback: Any, paths: list[str], best: str) -> None:
        """One artifact per checkpoint of ``paths`` not logged yet as it is now: the file with its ``.data``, or
        the folder's files, under the names they have in the checkpoint directory. Rank 0 only, as ``WandbLogger``
        (Lightning calls ``finalize`` on every rank)."""
        import wandb

        if getattr(rank_zero_only, "rank", 0) != 0:
            return
        for path in paths:
            when = unit_time(path)
            if when is None or self._logged_time.get(path, -1.0) >= when:
                continue  # gone, or logged as it is
            score = callback.best_k_models.get(path, callback.current_score if path == callback.last_model_path
                                               else None)
            metadata = {"score": score.item() if hasattr(score, "item") else score,
                        "original_filename": os.path.basename(path),
                        callback.__class__.__name__: {k: getattr(callback, k) for k in
                                                      ("monitor", "mode", "save_last", "save_top_k")}}
            artifact = wandb.Artifact(name=f"model-{self.experiment.id}", type="model", metadata=metadata)
            for file, name in unit_files(path):
                artifact.add_file(file, name=name)
            self.experiment.log_artifact(artifact, aliases=["latest", "best"] if path == best else ["latest"])
            self.checkpoint_artifacts[path] = artifact
            self._logged_time[path] = when


class OrtWandbLogger(WholeCheckpointsMixin, WandbLogger):
    """``WandbLogger`` that logs each checkpoint whole (its ``.data``, or a sharded checkpoint's folder), for
    ``pytorch_lightning`` Trainers: ``WandbLogger``'s arguments, ``log_model`` included (module doc)."""
