"""``Fabric(plugins=[OrtCheckpointIO()])``: what ``fabric.save`` hands the plugin, laid out as ORT needs it.

Fabric turns the modules and optimizers of ``fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})``
into their state dicts before its ``CheckpointIO`` sees them, so the plugin alone could not tell trainable
parameters from buffers, nor name optimizer moments. While the plugin is bound to a Fabric strategy
(``plugin.bind(fabric.strategy)``; or, deprecated, when Lightning hands it to one:
``_lightning_adapter.CHECKPOINT_IO_ASSIGNMENT``), :class:`FabricSaves` watches that strategy's
``save_checkpoint`` (that instance's, until the plugin's ``teardown``) and remembers which keys of the state hold which module and optimizer. The plugin then saves
the state in the layout of a Lightning checkpoint (``state_dict``: the module's, or the modules' under their keys;
``optimizer_states``: in the order of their keys), which ORT trains from, and records under :data:`FABRIC_KEY`
where each key went and the rest of the state; :func:`fabric_state` gives ``fabric.load`` the state back, key for
key, as it was saved (Fabric then restores the objects, ``strict`` or not).

Fabric's sharded strategies (FSDP, ModelParallel) take no ``CheckpointIO``: Lightning refuses the plugin when the
``Fabric`` is made.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _lightning_adapter
from .._translation.lightning_dict import ModuleInfo

FABRIC_KEY = "lightning_ort_ckpt.fabric"
"""Where a file saved by ``fabric.save`` records its layout: {"modules": [keys], "optimizers": [keys], "state":
the other keys}."""


def is_fabric_strategy(strategy: Any) -> bool:
    """Whether ``strategy`` is Fabric's (a Trainer's strategy has a ``lightning_module``)."""
    return not hasattr(type(strategy), "lightning_module")


class FabricSaves:
    """The modules and optimizers of the ``fabric.save`` in progress on one Fabric strategy."""

    def __init__(self, strategy: Any) -> None:
        self.pending: tuple[dict[str, torch.nn.Module], dict[str, torch.optim.Optimizer]] | None = None
        self.close = _lightning_adapter.wrap_fabric_save(strategy, self._save)
        """Puts Fabric's own ``save_checkpoint`` back on the strategy (the plugin's ``teardown``)."""

    def _save(self, original: Any, path: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        modules = {k: _unwrapped(v) for k, v in state.items() if isinstance(v, torch.nn.Module)}
        optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        self.pending = (modules, optimizers)
        try:
            original(path, state, *args, **kwargs)
        finally:
            self.pending = None

    def layout(self, state: dict[str, Any]) -> tuple[dict[str, Any], ModuleInfo] | None:
        """The state Fabric hands the plugin as a Lightning checkpoint dict, and what ORT needs to know of it; None
        outside a ``fabric.save`` (the plugin called directly)."""
        if self.pending is None:
            return None
        modules = {k: v for k, v in self.pending[0].items() if k in state}
        optimizers = {k: v for k, v in self.pending[1].items() if k in state}
        if len(modules) == 1:
            module: torch.nn.Module = next(iter(modules.values()))
            state_dict = state[next(iter(modules))]
        else:  # several modules: each under its key, as in a ModuleDict of them
            module = torch.nn.ModuleDict(modules)
            state_dict = {f"{key}.{name}": t for key in modules for name, t in state[key].items()}
        checkpoint = {"state_dict": state_dict, "optimizer_states": [state[k] for k in optimizers],
                      FABRIC_KEY: {"modules": list(modules), "optimizers": list(optimizers),
                                   "state": {k: v for k, v in state.items() if k not in modules and k not in optimizers}}}
        return checkpoint, ModuleInfo.from_module(module, list(optimizers.values()))


def fabric_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The state ``fabric.save`` saved, from the Lightning checkpoint dict of a file :class:`FabricSaves` laid out
    (any other dict as it is)."""
    layout = checkpoint.get(FABRIC_KEY)
    if not isinstance(layout, dict):
        return checkpoint
    modules, optimizers = layout["modules"], layout["optimizers"]
    state_dict = checkpoint.get("state_dict", {})
    state: dict[str, Any] = {}
    if len(modules) == 1:
        state[modules[0]] = state_dict
    for key in modules if len(modules) > 1 else []:
        state[key] = {name[len(key) + 1:]: t for name, t in state_dict.items() if name.startswith(f"{key}.")}
    state.update(zip(optimizers, checkpoint.get("optimizer_states", [])))
    state.update(layout["state"])
    return state


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose state dict Fabric saves (its DDP strategy saves the module inside ``DistributedDataParallel``)."""
    inner = getattr(module, "module", None)
    return inner if isinstance(module, torch.nn.parallel.DistributedDataParallel) and inner is not None else module
