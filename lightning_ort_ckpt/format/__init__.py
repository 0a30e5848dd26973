"""Layer 1: reads and writes ORT's ODTC checkpoint files. Knows nothing of Lightning or optimizers."""

from ._atomic import data_path
from ._contents import GROUP_ZERO, CheckpointContents, Deferred, OptimizerGroup, StoredAs
from ._dtypes import DataType
from ._reader import CheckpointReader, GroupInfo, TensorInfo, load_checkpoint, open_checkpoint
from ._writer import save_checkpoint

__all__ = [
    "GROUP_ZERO", "CheckpointContents", "CheckpointReader", "DataType", "Deferred", "GroupInfo", "OptimizerGroup", "TensorInfo",
    "StoredAs", "data_path", "load_checkpoint", "open_checkpoint", "save_checkpoint",
]
