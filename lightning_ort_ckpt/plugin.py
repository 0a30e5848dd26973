"""Deprecated: 0.2's ``lightning_ort_ckpt.plugin`` is private since 0.3; it goes in 0.4. The plugin is
``lightning_ort_ckpt.OrtCheckpointIO``; its readers moved to ``lightning_ort_ckpt._restore._reading``, which take a
store: the 0.2 readers here take ``storage_options`` still, and build the store of their path once."""

from __future__ import annotations

import os
from typing import Any

from .format._deprecated import moved_module

__getattr__ = moved_module(
    __name__, "lightning_ort_ckpt._plugin",
    "import OrtCheckpointIO from lightning_ort_ckpt (from lightning_ort_ckpt.lightning for lightning.pytorch), and "
    "load files with lightning_ort_ckpt.load or lightning_ort_ckpt.load_from_checkpoint",
    {"load_ort_for_lightning": "lightning_ort_ckpt._restore._reading:load_ort_for_lightning",
     "RNG_KEY": "lightning_ort_ckpt._fit_state._rng:RNG_KEY"})


def is_ort_checkpoint(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    from ._restore._reading import is_ort_checkpoint as read
    from .format._store import store_for

    return read(path, store_for(path, storage_options))


def read_lightning_checkpoint(path: str | os.PathLike[str], strategy: Any = None,
                              storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    from ._restore._reading import read_lightning_checkpoint as read
    from .format._store import store_for

    return read(path, strategy, store_for(path, storage_options))


def read_any_checkpoint(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    from ._restore._reading import read_any_checkpoint as read
    from .format._store import store_for

    return read(path, store_for(path, storage_options))


def read_weights(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    from ._restore._reading import read_weights as read
    from .format._store import store_for

    return read(path, store_for(path, storage_options))
