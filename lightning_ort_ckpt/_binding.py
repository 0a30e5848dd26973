"""How a plugin used without ``OrtCheckpoint`` learns which module and optimizers it saves.

``Trainer(plugins=[OrtCheckpointIO()])`` with Lightning's own ``ModelCheckpoint`` (or ``trainer.save_checkpoint``):
a ``CheckpointIO`` gets no reference to its Trainer from Lightning. This package registers callback factories under
Lightning's callback entry points (``pytorch_lightning.callbacks_factory`` and
``lightning.pytorch.callbacks_factory`` in ``pyproject.toml``), so every Trainer gets a :class:`BindCheckpointIO`,
whose ``setup`` (before anything is saved or restored, in every process of every launcher) binds the Trainer's
``OrtCheckpointIO``, bare or wrapped (``AsyncCheckpointIO``), to its strategy. It does nothing for other plugins.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.callbacks import Callback

from . import _lightning_adapter
from ._plugin import OrtCheckpointIOMixin


class BindCheckpointIOMixin:
    """The behaviour of both ``BindCheckpointIO`` callbacks."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = _lightning_adapter.raw_checkpoint_io(trainer.strategy)
        if not isinstance(io, OrtCheckpointIOMixin):
            io = getattr(io, "checkpoint_io", None)  # Lightning's wrapping plugins (AsyncCheckpointIO)
        if isinstance(io, OrtCheckpointIOMixin):
            io.bind(trainer.strategy)


class BindCheckpointIO(BindCheckpointIOMixin, Callback):
    """Binds an ``OrtCheckpointIO`` to its ``pytorch_lightning`` Trainer."""


def callbacks() -> list[Callback]:
    """The ``pytorch_lightning.callbacks_factory`` entry point: Lightning calls it for every Trainer."""
    return [BindCheckpointIO()]
