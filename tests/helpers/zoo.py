"""The zoo's fits (tests/conformance/test_zoo.py, tests/conformance/test_zoo_third_party.py): a zoo entry trained by a
real Trainer with our plugin written three ways, and bitwise comparison of states."""

from __future__ import annotations

import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_ort_ckpt import BindCheckpointIO, OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt.errors import CheckpointWarning

from helpers.ort_reference import assert_same_tensor
from helpers.zoo_models import BATCH, Entry


def loader(entry: Entry) -> torch.utils.data.DataLoader:
    x, y = entry.data()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)


MODES = ("bind", "alone", "callback")
"""How the user writes it: ``OrtCheckpointIO`` + ``BindCheckpointIO``; ``OrtCheckpointIO`` alone, beside Lightning's
own ``ModelCheckpoint`` (saving nothing itself here: ``save_top_k=0``); ``OrtCheckpoint`` (its own plugin)."""


def trainer(entry: Entry, callbacks: list[Any] = (), mode: str = "bind", **limits: Any) -> pl.Trainer:
    ours = {"bind": ([OrtCheckpointIO(**entry.plugin)], [BindCheckpointIO()]),
            "alone": ([OrtCheckpointIO(**entry.plugin)], [ModelCheckpoint(save_top_k=0)]),
            "callback": ([], [OrtCheckpoint(save_top_k=0, **entry.plugin)])}
    plugins, extra = ours[mode]
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=mode != "bind", plugins=plugins,
                      callbacks=[*callbacks, *extra], deterministic=True, **entry.trainer, **limits)


def fit(entry: Entry, model: Any, ckpt_path: Any = None, callbacks: list[Any] = (), mode: str = "bind",
        **limits: Any) -> tuple[pl.Trainer, list[str]]:
    """Fit, returning the trainer and the CheckpointWarnings raised."""
    t = trainer(entry, callbacks, mode, **limits)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model, loader(entry), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return t, [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for k, v in expected.items():
        assert_same_tensor(actual[k], v, f"{what}: {k}")
