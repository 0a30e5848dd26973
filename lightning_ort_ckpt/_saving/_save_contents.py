"""What one save of the plugin (``_plugin``) writes: the checkpoint dict as ORT contents, with the strategy whose
live module holds its tensors (what frozen sharing and asynchronous staging work from), and what an asynchronous
save will stage of that module, for the stager to allocate its memory ahead of the first save."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .._dcp import _strategies
from .._fit_state import _rng
from .._fit_state._rng import RNG_KEY
from .._translation.lightning_dict import ModuleInfo, to_ort
from ..errors import CheckpointWarning
from ..format import CheckpointContents


def ort_contents(checkpoint: dict[str, Any], path: str, fabric: tuple[Any, Any] | None, strategy: Any,
                 position: Callable[[], dict[str, Any]], ort_compatible: bool) -> tuple[CheckpointContents, Any]:
    """What is saved, as ORT contents, and the strategy whose live module holds its tensors (None for a gathered
    copy of a sharded module, Fabric's state (``fabric``: its layout), or a module not known: nothing to share
    with or defer to). ``strategy``: the one the plugin is bound to, if its module holds these tensors."""
    if fabric is not None:  # no random states: Fabric leaves them to the script
        return to_ort(fabric[0], fabric[1], ort_compatible=ort_compatible), None
    checkpoint = {**checkpoint, RNG_KEY: _rng.capture(), **position()}
    if strategy is None or strategy.lightning_module is None:
        warnings.warn(f"{path}: OrtCheckpointIO is not attached to a Trainer (it was called directly, or with a "
                      "state_dict that is not its module's), so it cannot tell trainable parameters from buffers: "
                      "all are saved as frozen, and optimizer state by index. ORT can load the file but not train "
                      "from it; save through trainer.save_checkpoint (or fabric.save) for one it trains from.",
                      CheckpointWarning, stacklevel=3)
        return to_ort(checkpoint, None, ort_compatible=ort_compatible), None
    info = ModuleInfo.from_module(strategy.lightning_module, list(strategy.optimizers))
    return (to_ort(checkpoint, info, ort_compatible=ort_compatible),
            None if _strategies.gathers(strategy) else strategy)


def staged_sources(strategy: Any) -> tuple[list[Any], list[Any]] | None:
    """What an asynchronous save will stage (the module's tensors, the optimizers) of the plugin's bound
    ``strategy``; None under the strategies whose state is sharded or gathered (``_strategies``: reading it is a
    collective, which a thread must not start)."""
    if strategy is None or strategy.lightning_module is None or _strategies.gathers(strategy):
        return None
    return list(strategy.lightning_module.state_dict(keep_vars=True).values()), list(strategy.optimizers)
