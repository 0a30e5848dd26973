"""lightning-ort-ckpt: checkpoints that move between PyTorch Lightning and ONNX Runtime on-device training.

Importing the package changes nothing in the process: no torch, no Lightning (the format layer needs only numpy; the
Lightning classes load on first use), no callback added to any Trainer, no Lightning function replaced. See
ARCHITECTURE.md for the layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import CheckpointConfigError, CheckpointError, CheckpointSaveError, CorruptCheckpointError
from .format import (CheckpointContents, CheckpointReader, DataType, OptimizerGroup, TensorInfo, load_checkpoint, open_checkpoint, save_checkpoint)

if TYPE_CHECKING:  # what the names below are, for type checkers; at run time they load on first use
    from ._binding import BindCheckpointIO
    from ._callback import OrtCheckpoint
    from ._export._consolidate import consolidate
    from ._export._export_callback import ExportBest
    from ._export._loading import load, load_from_checkpoint
    from ._plugin import OrtCheckpointIO
    from ._restore._reading import disable_ort_loading, enable_ort_loading
    from ._recovery._tiers import LocalTier
    from ._lightning._wandb import OrtWandbLogger

__version__ = "0.3.0"

_LAZY = {"OrtCheckpoint": "._callback", "OrtCheckpointIO": "._plugin", "BindCheckpointIO": "._binding",
         "enable_ort_loading": "._restore._reading", "disable_ort_loading": "._restore._reading",
         "consolidate": "._export._consolidate", "ExportBest": "._export._export_callback",
         "load": "._export._loading", "load_from_checkpoint": "._export._loading",
         "OrtWandbLogger": "._lightning._wandb", "LocalTier": "._recovery._tiers"}
_DEPRECATED = {"Checkpoint": "CheckpointContents"}  # 0.2's names (format/_deprecated.py: the rule)


def __getattr__(name: str) -> Any:
    """The Lightning classes load on first use, so the format layer and the CLI never import torch or Lightning."""
    if name in _LAZY:
        import importlib

        if name == "OrtCheckpoint":  # the export callback (layer 4) hands export_best_to its factory
            importlib.import_module("._export._export_callback", __name__)
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _DEPRECATED:
        from .format._deprecated import warn_once

        warn_once(f"lightning_ort_ckpt.{name}", f"use lightning_ort_ckpt.{_DEPRECATED[name]}")
        return globals()[_DEPRECATED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BindCheckpointIO", "CheckpointConfigError", "CheckpointContents", "CheckpointError", "CheckpointReader",
    "CheckpointSaveError", "CorruptCheckpointError", "DataType", "ExportBest", "LocalTier", "OptimizerGroup", "OrtCheckpoint",
    "OrtCheckpointIO", "OrtWandbLogger", "TensorInfo", "consolidate", "disable_ort_loading", "enable_ort_loading", "load",
    "load_checkpoint", "load_from_checkpoint", "open_checkpoint", "save_checkpoint",
]
