"""The classes for ``lightning.pytorch`` Trainers (the ``lightning`` package).

``from lightning_ort_ckpt.lightning import OrtCheckpoint, OrtCheckpointIO, BindCheckpointIO, OrtWandbLogger``
(``LocalTier`` is the same class in both); the top-level names
are for ``pytorch_lightning``. Importing this module imports ``lightning.pytorch``. A Trainer accepts callbacks and
plugins of its own copy of Lightning only; ``OrtCheckpoint`` of the other copy raises in ``setup``.
"""

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger

from ._export import _export_callback  # noqa: F401 - hands export_best_to its factory (layer 4: see the module)
from ._binding import BindCheckpointIOMixin
from ._callback import OrtCheckpointMixin
from ._plugin import OrtCheckpointIOMixin
from ._recovery._tiers import LocalTier
from ._lightning._wandb import WholeCheckpointsMixin


class OrtCheckpointIO(OrtCheckpointIOMixin, CheckpointIO):
    """``CheckpointIO`` writing ORT checkpoints, for ``lightning.pytorch`` Trainers (see ``OrtCheckpointIOMixin``)."""


class OrtCheckpoint(OrtCheckpointMixin, ModelCheckpoint):  # type: ignore[misc]  # (type checkers see both copies)
    """Lightning's ``ModelCheckpoint`` writing ORT checkpoints, for ``lightning.pytorch`` Trainers (see
    ``OrtCheckpointMixin``)."""

    plugin_class = OrtCheckpointIO


class BindCheckpointIO(BindCheckpointIOMixin, Callback):
    """Binds an ``OrtCheckpointIO`` to its ``lightning.pytorch`` Trainer (see ``lightning_ort_ckpt._binding``)."""


class OrtWandbLogger(WholeCheckpointsMixin, WandbLogger):
    """``WandbLogger`` logging each checkpoint whole, for ``lightning.pytorch`` Trainers (see ``_wandb``)."""


__all__ = ["BindCheckpointIO", "LocalTier", "OrtCheckpoint", "OrtCheckpointIO", "OrtWandbLogger"]
