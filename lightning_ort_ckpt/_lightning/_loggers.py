"""Checkpoints go to loggers whole: a file with its ``.data``, or a sharded checkpoint's folder.

Lightning's loggers that log checkpoints (``log_model=True`` or ``"all"``) upload one path per checkpoint, a file
(``Path(p).is_file()``, then that path alone): a checkpoint with a ``.data`` (``external_data``, frozen sharing, past
2 GiB) would reach the store without it, and a sharded checkpoint (a folder) not at all. We do not wrap the
loggers; ``OrtCheckpoint`` calls :func:`log_whole_units` after each save and at teardown, and where a logger logs
a checkpoint, this module logs the rest of it beside it, in the same artifact path:

- ``MLFlowLogger``: the ``.data`` beside the file (``log_artifact``), a folder whole (``log_artifacts``), under the
  artifact path the logger uses (the file's stem). With ``log_model="all"`` (or ``True`` and ``save_top_k=-1``) the
  logger logs after each save, and so do we; with ``True`` it logs at ``finalize``, after every callback's
  ``teardown``, and we log the same checkpoints in ours, just before.
- ``WandbLogger``: an artifact version cannot take a file once logged, so nothing is added beside it; users pass
  ``OrtWandbLogger`` (``_wandb``) instead, which logs each checkpoint whole itself.
- Every other logger that logs checkpoints (``WandbLogger``, ``LitLogger``, a logger of your own) gets one warning
  at setup (:func:`check_loggers`) naming what it will miss.
"""

from __future__ import annotations

import os
import warnings
import weakref
from pathlib import Path
from typing import Any

from . import _lightning_adapter
from ._namespaces import namespace_of
from ..errors import CheckpointWarning
from ..format import data_path
from ..format._atomic import FOLDER_COMMIT_NAME
from ..format._store import Stores

_SENT: weakref.WeakKeyDictionary[Any, dict[str, float]] = weakref.WeakKeyDictionary()
"""Per logger: the checkpoints whose other files we logged, with the modification time of the file then."""


def check_loggers(trainer: Any) -> None:
    """One warning per logger that logs checkpoints but is not taught to log them whole."""
    for logger in trainer.loggers:
        mode = _lightning_adapter.logger_log_model(logger)
        if mode and not _is_mlflow(logger):
            warnings.warn(
                f"{type(logger).__name__}(log_model={mode!r}) uploads one file per checkpoint: a checkpoint with a "
                "<file>.data (external_data, frozen sharing, past 2 GiB) reaches its store without it, and a "
                "sharded checkpoint (a folder) not at all. Upload the checkpoint files (or folders) yourself, or "
                "use MLFlowLogger, which lightning_ort_ckpt teaches to log them whole"
                + (", or lightning_ort_ckpt's OrtWandbLogger in place of WandbLogger" if _is_wandb(logger) else ""),
                CheckpointWarning, stacklevel=2)


def log_whole_units(trainer: Any, callback: Any, finishing: bool = False) -> None:
    """Log beside each checkpoint an MLflow logger logs (now, or at ``finalize`` when ``finishing``) the rest of it.
    Rank 0 only, as the loggers."""
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        mode = _lightning_adapter.logger_log_model(logger)
        if not mode or not _is_mlflow(logger):
            continue
        per_save = mode == "all" or (mode is True and callback.save_top_k == -1)
        if per_save != finishing:
            _log_rest(logger, callback)


def _is_mlflow(logger: Any) -> bool:
    return isinstance(logger, namespace_of(logger).attr("loggers.mlflow.MLFlowLogger"))


def _is_wandb(logger: Any) -> bool:
    return isinstance(logger, namespace_of(logger).attr("loggers.wandb.WandbLogger"))


def logged_checkpoints(callback: Any) -> list[str]:
    """The checkpoints a logger logs for ``callback``: its last, its best and its top k (local ones only)."""
    paths, stores = {callback.last_model_path, callback.best_model_path, *callback.best_k_models}, Stores()
    return sorted(p for p in paths if p and stores.of(p).local)  # one store asked, not one built per path


def unit_time(path: str) -> float | None:
    """When the checkpoint at ``path`` (a file, committed after its ``.data``, or a folder, committed by its commit
    file) was committed; None where there is no complete checkpoint."""
    folder = os.path.join(path, FOLDER_COMMIT_NAME)
    for committed in (folder, path):
        if os.path.isfile(committed):
            return os.stat(committed).st_mtime
    return None


def unit_files(path: str) -> list[tuple[str, str]]:
    """Every file of the checkpoint at ``path``, each with its name relative to the checkpoint directory: the file
    and its ``.data``, or every file of the folder."""
    name = os.path.basename(path.rstrip(os.sep))
    if os.path.isdir(path):
        return sorted((os.path.join(root, f), os.path.join(name, os.path.relpath(os.path.join(root, f), path)))
                      for root, _, files in os.walk(path) for f in files)
    rest = [(data_path(path), name + ".data")] if os.path.isfile(data_path(path)) else []
    return [(path, name), *rest]


def _log_rest(logger: Any, callback: Any) -> None:
    sent = _SENT.setdefault(logger, {})
    for path in logged_checkpoints(callback):
        folder = os.path.isfile(os.path.join(path, FOLDER_COMMIT_NAME))
        if not (folder or os.path.isfile(data_path(path))):
            continue  # one file: the logger's upload is complete
        mtime = unit_time(path)
        if mtime is None or sent.get(path, -1.0) >= mtime:
            continue
        artifact_path = Path(path).stem  # where MLFlowLogger logs the file
        if folder:
            logger.experiment.log_artifacts(logger.run_id, path, f"{artifact_path}/{os.path.basename(path)}")
        else:
            logger.experiment.log_artifact(logger.run_id, data_path(path), artifact_path)
        sent[path] = mtime
