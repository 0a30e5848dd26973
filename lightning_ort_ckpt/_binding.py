"""How a plugin used without ``OrtCheckpoint`` learns which module and optimizers it saves.

``Trainer(plugins=[OrtCheckpointIO()])`` with Lightning's own ``ModelCheckpoint`` (or ``trainer.save_checkpoint``):
a ``CheckpointIO`` gets no reference to its Trainer from Lightning. The one line that gives it one is a callback,
``Trainer(plugins=[OrtCheckpointIO()], callbacks=[BindCheckpointIO()])``: its ``setup`` (before anything is saved
or restored, in every process of every launcher) binds the Trainer's ``OrtCheckpointIO``, bare or wrapped
(``AsyncCheckpointIO``), to its strategy, and its ``on_train_start`` restores the random states of the checkpoint
the fit resumed from. ``OrtCheckpoint`` does both itself. Nothing is added to a Trainer that does not ask for it.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.callbacks import Callback

from . import _lightning_adapter
from ._plugin import OrtCheckpointIOMixin


def bound_plugin(trainer: Any) -> OrtCheckpointIOMixin | None:
    """The Trainer's ``OrtCheckpointIO`` (bare, or wrapped by Lightning's ``AsyncCheckpointIO``), or None."""
    io = _lightning_adapter.raw_checkpoint_io(trainer.strategy)
    if not isinstance(io, OrtCheckpointIOMixin):
        io = getattr(io, "checkpoint_io", None)
    return io if isinstance(io, OrtCheckpointIOMixin) else None


class BindCheckpointIOMixin:
    """The behaviour of both ``BindCheckpointIO`` callbacks."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = bound_plugin(trainer)
        if io is not None:
            io.bind(trainer.strategy)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        io = bound_plugin(trainer)
        if io is not None:
            io.restore_random_states(trainer)


class BindCheckpointIO(BindCheckpointIOMixin, Callback):
    """Binds an ``OrtCheckpointIO`` to its ``pytorch_lightning`` Trainer: ``callbacks=[BindCheckpointIO()]`` next to
    ``plugins=[OrtCheckpointIO()]`` when ``OrtCheckpoint`` is not used."""
