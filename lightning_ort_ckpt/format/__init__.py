"""Layer 1: reads and writes ORT's ODTC checkpoint files. Knows nothing of Lightning or optimizers."""

from .atomic import data_path
from .checkpoint import GROUP_ZERO, Checkpoint, OptimizerGroup, StoredAs
from .dtypes import DataType
from .reader import CheckpointReader, GroupInfo, TensorInfo, load_checkpoint, open_checkpoint
from .writer import save_checkpoint

__all__ = [
    "GROUP_ZERO", "Checkpoint", "CheckpointReader", "DataType", "GroupInfo", "OptimizerGroup", "TensorInfo",
    "StoredAs", "data_path", "load_checkpoint", "open_checkpoint", "save_checkpoint",
]
