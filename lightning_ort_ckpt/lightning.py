"""The classes for ``lightning.pytorch`` Trainers (the ``lightning`` package).

``from lightning_ort_ckpt.lightning import OrtCheckpoint, OrtCheckpointIO``; the top-level names are for
``pytorch_lightning``. ``OrtCheckpointIO`` is the same class in both: it derives from both copies' ``CheckpointIO``.
"""

from lightning.pytorch.callbacks import ModelCheckpoint

from .callback import OrtCheckpointMixin
from .plugin import OrtCheckpointIO


class OrtCheckpoint(OrtCheckpointMixin, ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` writing ORT checkpoints, for ``lightning.pytorch`` Trainers (see
    ``lightning_ort_ckpt.callback``)."""


__all__ = ["OrtCheckpoint", "OrtCheckpointIO"]
