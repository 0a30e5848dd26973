"""A save that validation follows resumes into that validation, as the uninterrupted run went on.

A save at the end of a training batch (``every_n_train_steps``) comes before the validation that follows that batch
(``val_check_interval``). Lightning resumes such a file past that validation: it is never run, so what it draws
from the random generators (a shuffled validation loader, noise in ``validation_step``), the values it logs, and the
monitored value that ranks saves and stops early all differ from the uninterrupted run's. So the save records that
validation was due (:data:`VALIDATION_KEY`, the step), and the resume turns the loops' state into that of a save
at that validation's first batch: Lightning restarts it from its first batch, ends the epoch where that batch was
its last (Lightning would skip the epoch's end too), then trains on (``_lightning_adapter.loops_into_validation``).
A file without the record (ORT's, Fabric's, an older version's) resumes as Lightning resumes it.
"""

from __future__ import annotations

import warnings
from typing import Any

from .._lightning import _lightning_adapter
from ..errors import CheckpointWarning

VALIDATION_KEY = "lightning_ort_ckpt.validation_due"
"""The step whose validation a checkpoint was saved before (saved at that step's training batch end)."""
UNDECIDABLE_KEY = "lightning_ort_ckpt.validation_not_rerun"
"""The same, for a validation decided by elapsed time or ``trainer.should_stop``: a resume warns that it is not
run (a fresh Trainer cannot decide it as the saving run did)."""


def due(strategy: Any) -> dict[str, Any]:
    """``{VALIDATION_KEY: step}`` where the fit of ``strategy``'s module saves now, at the end of a training batch
    that validation follows (``{UNDECIDABLE_KEY: step}`` where the resume cannot rerun it); else ``{}``."""
    module = strategy.lightning_module if strategy is not None else None
    trainer = _lightning_adapter.trainer_of(module) if module is not None else None
    if trainer is None or not _lightning_adapter.fitting(strategy):
        return {}
    rule = _lightning_adapter.saved_before_validation(trainer)
    return {} if rule is None else {VALIDATION_KEY if rule == "batches" else UNDECIDABLE_KEY: int(trainer.global_step)}


def resume_into_validation(checkpoint: dict[str, Any], fitting: bool, path: str = "") -> int | None:
    """Take the records out of ``checkpoint``; for a fit (``fitting``), rewrite its loops' state to run the
    validation it was saved before (or warn that it is not run). The step of that validation where it did: the
    caller then calls :func:`settle` when training starts."""
    step = checkpoint.pop(VALIDATION_KEY, None)
    skipped = checkpoint.pop(UNDECIDABLE_KEY, None)
    if fitting and isinstance(skipped, int) and checkpoint.get("global_step") == skipped:
        warnings.warn(f"{path}: the checkpoint was saved right before the validation after step {skipped}, which "
                      "ran by elapsed time or because the fit was stopping; a resumed fit cannot decide it the same "
                      "way and does not run it: random states, logged metrics and the monitored value differ from "
                      "the uninterrupted run", CheckpointWarning, stacklevel=2)
    if not fitting or not isinstance(step, int) or checkpoint.get("global_step") != step:
        return None
    return step if _lightning_adapter.loops_into_validation(checkpoint.get("loops")) else None


def settle(trainer: Any, step: int, path: str) -> None:
    """When training starts, after the loops restored themselves (see ``_lightning_adapter``); a Trainer that does
    not validate after ``step`` (its validation settings changed) is told what differs."""
    if not _lightning_adapter.settle_validation_restart(trainer):
        warnings.warn(f"{path}: the checkpoint was saved right before the validation after step {step}, which "
                      "this Trainer does not run there (its validation settings differ from the saving run's): "
                      "random states, logged metrics and the monitored value differ from the uninterrupted run",
                      CheckpointWarning, stacklevel=2)
