"""The callback a plugin used alone adds to its Trainer, to restore a resumed fit's random states.

A fit resumed from one of our files restores the random states it saved when training starts (``on_train_start``:
after Lightning built the data loaders, as in the uninterrupted run), which takes a callback. ``OrtCheckpoint`` and
``BindCheckpointIO`` are such callbacks; a Trainer with neither (``plugins=[OrtCheckpointIO()]`` with Lightning's
``ModelCheckpoint``) gets :class:`RestoreRandomStates` from the plugin when it loads the checkpoint of a fit, once
per Trainer, taken out again at the plugin's ``teardown``. A second restore finds nothing left to do, so a Trainer with both restores once.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from torch.nn.parallel import DistributedDataParallel

from . import _rng, _validation_resume
from .._lightning import _lightning_adapter
from ._data_position import DATA_KEY, TrainData
from .._lightning._namespaces import namespace_of
from ._rng import RNG_KEY
from ..errors import CheckpointWarning, CorruptCheckpointError


class Restorer(Protocol):
    def restore_random_states(self, trainer: Any) -> None: ...


class RestoreRandomStates:
    """``on_train_start``: the plugin restores the random states of the checkpoint the fit resumed from."""

    def __init__(self, plugin: Restorer) -> None:
        self._plugin = weakref.ref(plugin)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        plugin = self._plugin()
        if plugin is not None:
            plugin.restore_random_states(trainer)


@functools.cache
def _callback_class(callback_base: type) -> type:
    """:class:`RestoreRandomStates` as a ``Callback`` of one copy of Lightning (a Trainer takes only its own)."""
    return type("RestoreRandomStates", (RestoreRandomStates, callback_base), {"__module__": __name__})


def restore_at_train_start(trainer: Any, plugin: Restorer) -> Callable[[], None]:
    """Give ``trainer`` the callback that has ``plugin`` restore the random states when training starts (once);
    returns what takes it out again (the plugin's ``teardown``: nothing of ours stays in the Trainer's list)."""
    if any(isinstance(c, RestoreRandomStates) for c in trainer.callbacks):
        return lambda: None
    callback = _callback_class(namespace_of(trainer).attr("callbacks.Callback"))(plugin)
    trainer.callbacks.append(callback)
    return lambda: trainer.callbacks.remove(callback) if callback in trainer.callbacks else None


class TrainStart:
    """What a fit resumed from one of our files restores when training starts, for one plugin: the random states,
    the data position of the bound strategy's training loaders (``_data_position``), the validation its checkpoint
    was saved before (``_validation_resume``), and the callback that asks for it where no callback of ours does
    (taken out at :meth:`end_fit`)."""

    def __init__(self) -> None:
        self._pending: tuple[Any, Any, str] | None = None  # (random states, epoch, path) of the checkpoint
        self._into_validation: tuple[int, str] | None = None  # (step, path): the validation resumed into
        self._data: TrainData | None = None
        self._remove: Callable[[], None] = lambda: None

    def bind(self, strategy: Any, fast_forward_iterables: bool, data_ready: Callable[[Any], None]) -> None:
        """Watch ``strategy``'s training loaders from now on (no longer those of a strategy bound before);
        ``data_ready(strategy)`` is called whenever Lightning sets up one of its loaders (its optimizers exist by
        then)."""
        if self._data is not None:
            self._data.close()
        self._data = TrainData(strategy, fast_forward_iterables, data_ready)

    def position(self) -> dict[str, Any]:
        """``{DATA_KEY: position}`` of the fit in progress, or ``{}``."""
        position = self._data.position() if self._data is not None else None
        return {DATA_KEY: position} if position is not None else {}

    def resume_from(self, checkpoint: dict[str, Any], path: str, trainer: Any, plugin: Restorer) -> None:
        """``trainer`` fits from ``checkpoint`` (read from ``path``); None: the load is not a fit's."""
        step = _validation_resume.resume_into_validation(checkpoint, trainer is not None, path)
        if step is not None:  # (a sharded strategy's full-state load hands the same checkpoint twice)
            self._into_validation = (step, path)
        if trainer is None:
            self._pending = None
            return
        self._pending = (checkpoint.get(RNG_KEY), checkpoint.get("epoch"), path)
        if self._data is not None:
            self._data.resume_at(checkpoint.get(DATA_KEY), path)
        self._remove()
        self._remove = restore_at_train_start(trainer, plugin)

    def at_train_start(self, trainer: Any) -> None:
        pending, self._pending = self._pending, None
        into, self._into_validation = self._into_validation, None
        if into is not None:
            _validation_resume.settle(trainer, *into)
        if pending is not None:
            restore(*pending, trainer, self._data)

    def end_fit(self) -> None:
        self._into_validation = None
        if self._data is not None:
            self._data.end_fit()
        self._remove()
        self._remove = lambda: None


def restore(states: Any, epoch: Any, path: str, trainer: Any, data: TrainData | None = None) -> None:
    """Restore the random ``states`` a fit resumed from (the file ``path``, saved in ``epoch``) as training starts.

    Lightning has built the data loaders by then, from the same random states as the uninterrupted run (a dataset
    drawn in ``train_dataloader()`` is the same), and drawn the training iterator. A file saved inside its epoch
    resumes inside it, where the uninterrupted run had drawn that iterator before the save; a file saved at the end
    of an epoch resumes at the next, whose iterator the uninterrupted run drew after the save: it is drawn again,
    from the restored states. Inside an epoch, each training loader went on from the batch it stood at (``data``,
    the data positions: ``_data_position``); a file without random states (ORT's, Fabric's) changes nothing.
    """
    if states is not None:
        try:
            _rng.restore(states)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
            raise CorruptCheckpointError(f"its saved random states are damaged ({e})", path) from None
    _warn_if_ddp_sums_otherwise(trainer, path)
    inside = _lightning_adapter.resumed_inside_epoch(trainer, epoch)
    if data is not None:
        data.check_resumed(trainer, inside)
    if states is not None and not inside:
        _lightning_adapter.restart_train_iterator(trainer)


def _warn_if_ddp_sums_otherwise(trainer: Any, path: str) -> None:
    """The one way we know a resume is not bitwise that no checkpoint can fix: torch's DDP reducer sums the ranks'
    gradients in an order that depends on where each lies in its bucket, and lays the buckets out again after the
    first step of every newly wrapped module, so at more than 2 ranks a resumed fit's first steps sum in another
    order than the uninterrupted run's (docs/guide.md, "Strategies"). Said once, by rank 0."""
    if isinstance(getattr(trainer.strategy, "model", None), DistributedDataParallel) and trainer.world_size > 2 \
            and trainer.is_global_zero:
        warnings.warn(f"{path}: resumed under DDP with {trainer.world_size} processes: DDP sums the ranks' gradients "
                      "of a newly wrapped module's first steps in another order than the uninterrupted run did, so "
                      "the weights may differ from its in their last bits (about 1e-8); bitwise with 2 processes, "
                      "or with a DDP communication hook that sums in rank order", CheckpointWarning, stacklevel=2)
