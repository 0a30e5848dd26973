"""A module with a checkpoint's weights in it, for export and for training artifacts: one way to build it (a
LightningModule class rebuilt from its saved hyperparameters, or a module instance given), one way to say why the
weights do not fit, in the caller's own error (``ExportError``, ``ArtifactsError``)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .._restore._reading import serving
from .._translation.lightning_dict import with_aliases
from ..errors import CheckpointError


def init_params(cls: type) -> list[inspect.Parameter]:
    """The arguments ``cls(...)`` takes by name."""
    return [p for p in inspect.signature(cls).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def unsaved_init_args(cls: type, hparams: dict[str, Any], hparams_name: Any) -> list[str]:
    """``__init__`` arguments ``load_from_checkpoint`` would not get from the hyperparameters (it passes the whole
    hparams as the argument ``save_hyperparameters(obj)`` was given, when there was one)."""
    return [p.name for p in init_params(cls) if p.name not in hparams and p.name != hparams_name]


def load_module(model: Any, checkpoint: str, state: dict[str, Any], error: type[CheckpointError]) -> torch.nn.Module:
    """``model`` (a LightningModule class, rebuilt with ``load_from_checkpoint`` from ``state``, the checkpoint
    read already; or a module instance) with the weights of ``checkpoint``; weights that do not fit raise ``error``
    naming the first mismatch (and the ``__init__`` arguments the hyperparameters lack, where that is why)."""
    if isinstance(model, type):
        if not hasattr(model, "load_from_checkpoint"):
            raise error(f"{model.__name__} is not a LightningModule class; pass a module instance instead")
        try:
            with serving(checkpoint, state):  # what was read: the file is not read again
                loaded: torch.nn.Module = model.load_from_checkpoint(checkpoint, map_location="cpu")
                return loaded
        except RuntimeError as e:
            if "Error(s) in loading state_dict" not in str(e):
                raise
            unsaved = unsaved_init_args(model, dict(state.get("hyper_parameters") or {}), state.get("hparams_name"))
            why = (f": its __init__ arguments {', '.join(unsaved)} are not in the saved hyperparameters, so they "
                   f"took their defaults; call self.save_hyperparameters() in __init__" if unsaved else "")
            raise error(f"the checkpoint's weights do not fit {model.__name__} built from its saved "
                        f"hyperparameters ({_state_dict_problem(e)}){why}", checkpoint) from None
    try:
        model.load_state_dict(with_aliases(state["state_dict"], model))
    except RuntimeError as e:
        raise error(f"the checkpoint's weights do not fit the {type(model).__name__} given "
                    f"({_state_dict_problem(e)})", checkpoint) from None
    return model


def _state_dict_problem(error: RuntimeError) -> str:
    """The first line of ``load_state_dict``'s complaint (a size mismatch, missing or unexpected keys)."""
    lines = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
    return (lines[0] if lines else str(error)).rstrip(".")
