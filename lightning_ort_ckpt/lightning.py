"""The classes for ``lightning.pytorch`` Trainers (the ``lightning`` package).

``from lightning_ort_ckpt.lightning import OrtCheckpoint, OrtCheckpointIO``; the top-level names are for
``pytorch_lightning``. Importing this module imports ``lightning.pytorch``.
"""

from lightning.pytorch.callbacks import ModelCheckpoint

from .callback import OrtCheckpointMixin
from .namespaces import named
from .plugin import plugin_class_for

OrtCheckpointIO = plugin_class_for(named("lightning.pytorch"))


class OrtCheckpoint(OrtCheckpointMixin, ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` writing ORT checkpoints, for ``lightning.pytorch`` Trainers (see
    ``lightning_ort_ckpt.callback``)."""


__all__ = ["OrtCheckpoint", "OrtCheckpointIO"]
