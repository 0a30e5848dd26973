"""The Lightning packages installed here.

``pytorch_lightning`` and ``lightning.pytorch`` (the ``lightning`` package) ship separate copies of the same classes,
and a Trainer accepts only callbacks and plugins of its own copy. Our plugin derives from every copy's
``CheckpointIO`` and works in both; the callback comes in one class per copy (``lightning_ort_ckpt.OrtCheckpoint``
for ``pytorch_lightning``, ``lightning_ort_ckpt.lightning.OrtCheckpoint`` for ``lightning.pytorch``).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Namespace:
    """One installed copy of Lightning: its trainer package and the fabric package it uses."""

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


def _installed() -> list[Namespace]:
    found = []
    for trainer, fabric in (("pytorch_lightning", "lightning_fabric"), ("lightning.pytorch", "lightning.fabric")):
        try:
            present = importlib.util.find_spec(trainer) is not None
        except ModuleNotFoundError:  # the parent package `lightning` is absent
            present = False
        if present:
            found.append(Namespace(importlib.import_module(trainer), importlib.import_module(fabric)))
    return found


NAMESPACES = _installed()


def namespace_of(obj: Any) -> Namespace:
    """The copy of Lightning an object (a strategy, a trainer) comes from."""
    module = type(obj).__module__
    for ns in NAMESPACES:
        if module == ns.trainer.__name__ or module.startswith(ns.trainer.__name__ + "."):
            return ns
    return NAMESPACES[0]
