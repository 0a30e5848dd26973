"""lightning-ort-ckpt: checkpoints that move between PyTorch Lightning and ONNX Runtime on-device training.

Importing the package does not import torch; the format layer needs only numpy. It does teach Lightning's torch
loader to read ORT files (``LightningModule.load_from_checkpoint``, spawn launchers), in copies of Lightning
imported before or after it: see ``lightning_ort_ckpt._lightning_adapter.install_ort_loader``.
"""

from . import _lightning_adapter
from .errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from .format import (CheckpointContents, CheckpointReader, DataType, OptimizerGroup, TensorInfo, load_checkpoint,
                     open_checkpoint, save_checkpoint)

__version__ = "0.1.0"

_lightning_adapter.install_ort_loader()


def __getattr__(name: str) -> object:
    """The Lightning classes load on first use, so the format layer and the CLI never import torch or Lightning."""
    if name == "OrtCheckpointIO":
        from ._plugin import OrtCheckpointIO

        return OrtCheckpointIO
    if name == "OrtCheckpoint":
        from ._callback import OrtCheckpoint

        return OrtCheckpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Checkpoint", "CheckpointError", "CheckpointReader", "CheckpointSaveError", "CorruptCheckpointError",
    "DataType", "OptimizerGroup", "OrtCheckpoint", "OrtCheckpointIO", "TensorInfo", "load_checkpoint", "open_checkpoint", "save_checkpoint",
]
