"""Layer 1: reads and writes ORT's ODTC checkpoint files. Knows nothing of Lightning or optimizers."""

from ._contents import GROUP_ZERO, CheckpointContents, Deferred, OptimizerGroup, StoredAs
from ._dtypes import DataType
from ._naming import data_path
from ._reader import CheckpointReader, GroupInfo, TensorInfo, load_checkpoint, open_checkpoint
from ._store import Store, store_for
from ._writer import save_checkpoint


def __getattr__(name: str) -> object:
    """0.2's ``Checkpoint``, renamed ``CheckpointContents`` in 0.3 (it shadowed Lightning's ``Checkpoint``)."""
    if name == "Checkpoint":
        from ._deprecated import warn_once

        warn_once("lightning_ort_ckpt.format.Checkpoint", "use lightning_ort_ckpt.format.CheckpointContents")
        return CheckpointContents
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "GROUP_ZERO", "CheckpointContents", "CheckpointReader", "DataType", "Deferred", "GroupInfo", "OptimizerGroup", "TensorInfo",
    "Store", "StoredAs", "data_path", "load_checkpoint", "open_checkpoint", "save_checkpoint", "store_for",
]
