"""The copies of Lightning in use.

``pytorch_lightning`` and ``lightning.pytorch`` (the ``lightning`` package) ship separate copies of the same classes,
and a Trainer accepts only callbacks and plugins of its own copy. Importing a copy takes seconds, so only copies the
process has imported count: ``pytorch_lightning`` (our dependency, imported by the plugin) and ``lightning.pytorch``
once the user (or ``lightning_ort_ckpt.lightning``) imports it. Lightning's private names are in
``_lightning_adapter``.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_COPIES = (("pytorch_lightning", "lightning_fabric"), ("lightning.pytorch", "lightning.fabric"))


@dataclass(frozen=True)
class Namespace:
    """One copy of Lightning: its trainer package and the fabric package it uses."""

    trainer: ModuleType  # pytorch_lightning or lightning.pytorch
    fabric: ModuleType  # lightning_fabric or lightning.fabric

    @property
    def version(self) -> str:
        return self.trainer.__version__

    def attr(self, dotted: str) -> Any:
        """``attr("strategies.Strategy")`` is ``<trainer package>.strategies.Strategy``."""
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(f"{self.trainer.__name__}.{module}"), name)

    def fabric_attr(self, dotted: str) -> Any:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(f"{self.fabric.__name__}.{module}"), name)


def loaded() -> list[Namespace]:
    """The copies of Lightning imported in this process."""
    return [Namespace(sys.modules[trainer], importlib.import_module(fabric))
            for trainer, fabric in _COPIES if trainer in sys.modules]


def namespace_of(obj: Any) -> Namespace:
    """The copy of Lightning an object (a strategy, a trainer) comes from."""
    module = type(obj).__module__
    copies = loaded()
    for ns in copies:
        if module == ns.trainer.__name__ or module.startswith(ns.trainer.__name__ + "."):
            return ns
    return copies[0]
