"""lightning-ort-ckpt: checkpoints that move between PyTorch Lightning and ONNX Runtime on-device training.

Importing the package does not import torch; the format layer needs only numpy.
"""

from .errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from .format import (Checkpoint, CheckpointReader, DataType, OptimizerGroup, TensorInfo, load_checkpoint,
                     open_checkpoint, save_checkpoint)

__version__ = "0.1.0"

__all__ = [
    "Checkpoint", "CheckpointError", "CheckpointReader", "CheckpointSaveError", "CorruptCheckpointError",
    "DataType", "OptimizerGroup", "TensorInfo", "load_checkpoint", "open_checkpoint", "save_checkpoint",
]
