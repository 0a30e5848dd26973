"""How an ``OrtCheckpointIO`` learns the strategy it serves and serves it (the plugin's :class:`StrategyBinding`
part): bound by ``OrtCheckpoint``, ``BindCheckpointIO`` or a Fabric script (``bind``), or, deprecated, found through
Lightning's assignment (``_lightning_adapter.CHECKPOINT_IO_ASSIGNMENT``) or at its first call in a spawned process,
with a ``FutureWarning``."""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any, cast

from ._dcp import _strategies
from ._fit_state._train_start import TrainStart
from ._lightning import _fabric, _lightning_adapter
from ._saving import _save_contents
from ._saving._async_saver import SaveExecutor


class StrategyBinding:
    """The strategy side of the plugin (``_plugin.OrtCheckpointIOMixin``, which makes these attributes)."""

    _owner: weakref.ref[Any] | None
    _assignment: Callable[[], object]
    _found_by: str | None  # how the strategy was found without being bound, until that is warned of
    _fabric: _fabric.FabricSaves | None
    _attachment: _strategies.Attachment | None
    _unwrap: Callable[[], None] | None
    _train_start: TrainStart
    _executors: dict[bool, SaveExecutor]
    fast_forward_iterables: bool
    async_save: bool

    def _owner_strategy(self, state_dict: dict[str, Any] | None = None) -> Any:
        """The strategy this plugin is bound to, while it still uses this plugin (and, given the ``state_dict``
        being saved, while its module holds those tensors); else None."""
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            owner = _lightning_adapter.calling_strategy(self)
            if owner is None:
                return None
            self._ort_ckpt_assigned_to(owner)  # a Trainer that came pickled (spawn): bound at its first call
            self._found_by = "at its first save or load (the Trainer came pickled: ddp_spawn)"
        self._warn_if_found()
        io = _lightning_adapter.raw_checkpoint_io(owner)
        if io is not self and getattr(io, "checkpoint_io", None) is not self:  # used bare, or wrapped (async)
            return None
        return owner if not state_dict or _holds(owner, state_dict) else None

    def bind(self, strategy: Any) -> None:
        """Serve ``strategy``, held weakly: ``OrtCheckpoint`` and ``BindCheckpointIO`` call this in ``setup``, before
        anything is saved or restored; a Fabric script calls ``plugin.bind(fabric.strategy)`` once the ``Fabric``
        is made. A sharded strategy (``ModelParallelStrategy``, ``FSDPStrategy``), which saves and loads without
        its ``CheckpointIO``, saves and loads through this plugin until :meth:`teardown` (``_strategies``);
        DeepSpeed is refused here. Bound so, the plugin needs no word of Lightning's assignment any more: it lets go
        of the ``checkpoint_io`` setter's wrap (deprecated, ``_lightning_adapter.CHECKPOINT_IO_ASSIGNMENT``)."""
        self._assignment()
        self._found_by = None
        if _fabric.is_fabric_strategy(strategy):
            return self._watch_fabric(strategy)
        self._bind(strategy)

    def _bind(self, strategy: Any) -> None:
        self._owner = weakref.ref(strategy)
        _lightning_adapter.import_what_saves_import()  # not from inside a save a signal handler starts
        if self._attachment is not None:  # bound before (when Lightning assigned it, then by a callback's setup)
            self._attachment.undo()
        self._attachment = _strategies.attach(strategy, cast(_strategies.Plugin, self))  # the plugin is both
        self._unwrap = self._attachment.undo if self._attachment is not None else None
        self._train_start.bind(strategy, self.fast_forward_iterables, _arming(self._executors[True], self._attachment))
        self._executors[True].prepare(functools.partial(_staged_sources, weakref.ref(self)))

    def _ort_ckpt_assigned_to(self, strategy: Any) -> None:
        """Lightning gave this plugin to ``strategy`` (``_lightning_adapter.CHECKPOINT_IO_ASSIGNMENT``): bound to it
        fit after fit while the strategy holds it (a sharded one keeps saving and loading through it after
        ``teardown``), as if ``BindCheckpointIO`` were there; DeepSpeed is refused here, when the Trainer is made."""
        self._found_by = "through a process-wide wrap of Lightning's Strategy.checkpoint_io setter"
        if _fabric.is_fabric_strategy(strategy):
            return self._watch_fabric(strategy)
        self._bind(strategy)
        self._unwrap = self._attachment.close if self._attachment is not None else None

    def _watch_fabric(self, strategy: Any) -> None:
        """A Fabric strategy's saves are watched for their modules and optimizers until :meth:`teardown`."""
        if self._fabric is not None:
            self._fabric.close()
        self._fabric = _fabric.FabricSaves(strategy)
        self._unwrap = self._fabric.close

    def _warn_if_found(self) -> None:
        """Once: this plugin serves a strategy it found itself, as 0.6 will no longer do (see :meth:`bind`)."""
        found, self._found_by = self._found_by, None
        if found is not None:
            warnings.warn(
                f"OrtCheckpointIO was not bound to the strategy it serves: it found it {found}, which is "
                "deprecated and stops in 0.6. Add BindCheckpointIO() to the Trainer's callbacks (or use "
                "OrtCheckpoint); with Fabric, call plugin.bind(fabric.strategy).", FutureWarning, stacklevel=2)

def _staged_sources(plugin: weakref.ref[StrategyBinding]) -> tuple[list[Any], list[Any]] | None:
    """What an asynchronous save of ``plugin`` will stage, for its staging memory to allocate ahead (only while
    ``async_save`` is on). The plugin's own ``BackgroundSaves`` holds this: weakly, or the plugin would be on a
    reference cycle of its own, freed only by the garbage collector."""
    io = plugin()
    return _save_contents.staged_sources(io._owner_strategy()) if io is not None and io.async_save else None


def _arming(executor: SaveExecutor, attachment: _strategies.Attachment | None) -> Callable[[Any], None]:
    """What hands a strategy's optimizers, once its training data is set up (they exist by then), to the staging
    memory of the plugin's asynchronous saves and of a sharded strategy's: they wait for the first steps."""
    def arm(strategy: Any) -> None:
        executor.arm(list(strategy.optimizers))
        if attachment is not None:
            attachment.arm(list(strategy.optimizers))

    return arm


def _holds(strategy: Any, state_dict: dict[str, Any]) -> bool:
    """Whether the strategy's module owns the memory of the checkpoint's tensors (state_dict entries are views)."""
    import torch

    module = strategy.lightning_module
    if module is None:
        return False
    if _strategies.gathers(strategy):  # a gathered copy, and module.state_dict() would start a collective
        return _strategies.names_match(strategy, state_dict)
    live = module.state_dict(keep_vars=True)
    return any(isinstance(t, torch.Tensor) and k in live and live[k].data_ptr() == t.data_ptr()
               for k, t in state_dict.items())
