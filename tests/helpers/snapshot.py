"""A snapshot of the process state a plugin or callback of ours could change for the whole process (issue 40, point
1), taken by tests/conformance/test_nothing_global.py: compare two with :func:`differences`."""

from __future__ import annotations

import sys
import threading
from typing import Any

from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ort_ckpt import _lightning_adapter

_CONNECTORS = ("pytorch_lightning.trainer.connectors.checkpoint_connector",
               "lightning.pytorch.trainer.connectors.checkpoint_connector")
_STRATEGY_METHODS = ("checkpoint_io", "save_checkpoint", "load_checkpoint", "remove_checkpoint", "teardown",
                     "process_dataloader")
STILL_GLOBAL = {f"{module}.{name}.checkpoint_io" for module, name in _lightning_adapter.STRATEGY_CLASSES}
"""What is still wrapped while an ``OrtCheckpointIO`` exists (issue 40, point 1a: not done yet)."""


def snapshot() -> dict[str, Any]:
    """Everything of Lightning's and torch's that a plugin or callback of ours could change for the whole process,
    by name: compared by identity."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    state: dict[str, Any] = {}
    for module_name, name in _lightning_adapter.STRATEGY_CLASSES:
        cls = getattr(sys.modules.get(module_name), name, None)
        for attr in _STRATEGY_METHODS:
            state[f"{module_name}.{name}.{attr}"] = cls.__dict__.get(attr) if cls is not None else None
    for module_name in _CONNECTORS:
        connector = getattr(sys.modules.get(module_name), "_CheckpointConnector", None)
        state[f"{module_name}._parse_ckpt_path"] = connector.__dict__.get("_parse_ckpt_path") if connector else None
    for module_name, attr in _lightning_adapter.LOADER_BINDINGS:
        state[f"{module_name}.{attr}"] = getattr(sys.modules.get(module_name), attr, None)
    state["DataLoader._get_iterator"] = DataLoader.__dict__["_get_iterator"]
    state["ModelCheckpoint._find_last_checkpoints"] = ModelCheckpoint.__dict__["_find_last_checkpoints"]
    state["torch global optimizer pre-hooks"] = tuple(_global_optimizer_pre_hooks.values())
    state["torch global optimizer post-hooks"] = tuple(_global_optimizer_post_hooks.values())
    state["threads"] = tuple(sorted((t.ident or 0, t.name) for t in threading.enumerate() if t.is_alive()))
    return state


def differences(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, tuple) and isinstance(b, tuple):
            return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b))
        return a is b

    return {key for key in before.keys() | after.keys() if not same(before.get(key), after.get(key))}
