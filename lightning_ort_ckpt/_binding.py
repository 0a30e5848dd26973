"""``BindCheckpointIO``: the callback that binds an ``OrtCheckpointIO`` used without ``OrtCheckpoint``.

Its ``setup`` (before anything is saved or restored, in every process of every launcher) binds the Trainer's
``OrtCheckpointIO``, bare or wrapped (``AsyncCheckpointIO``), to its strategy, and its ``on_train_start`` restores
the random states of the checkpoint the fit resumed from. ``OrtCheckpoint`` does both itself. Bound so, the plugin
lets go of the process-wide wrap of Lightning's ``checkpoint_io`` setter through which a plugin left alone finds its
strategy (``_lightning_adapter.CHECKPOINT_IO_ASSIGNMENT``, deprecated with a ``FutureWarning``, goes in 0.6)."""

from __future__ import annotations

from typing import Any

from pytorch_lightning.callbacks import Callback

from ._lightning import _lightning_adapter
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
