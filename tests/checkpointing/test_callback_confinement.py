"""Deletes and links stay inside ``dirpath`` (issue #17, point 1): paths restored from a checkpoint's callback state
are not trusted.

A checkpoint is crafted whose ``OrtCheckpoint`` state names files outside ``dirpath`` in every field the callback may
delete or link from: ``best_k_models``, ``kth_best_model_path``, ``best_model_path``, ``last_model_path``, our
``saved`` list and ``last_unranked``; through ``ckpts/../victim.ckpt`` (which Lightning's own check, not normalizing
``..``, takes for a file inside ``ckpts``), an absolute path elsewhere, and a folder inside ``ckpts`` that is a
symbolic link to another directory. A resumed fit whose rotation drops each of them must leave every one of those
files (and their ``.data``) as they were.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from lightning_ort_ckpt import OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
from helpers.fits import STEPS_PER_EPOCH, Net, _data, name


@pytest.fixture(autouse=True)
def _restore_seed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(env, raising=False)


def _fit(callback: OrtCheckpoint, epochs: int, vals: list[float], ckpt_path: str | None = None) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, max_epochs=epochs, callbacks=[callback], num_sanity_val_steps=0)
    trainer.fit(Net(vals), DataLoader(_data(), batch_size=2), DataLoader(_data(), batch_size=2 * STEPS_PER_EPOCH),
                ckpt_path=ckpt_path)
    return trainer


def _plant(path: Any, content: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for p, data in ((path, content), (str(path) + ".data", content + b" data")):
        with open(p, "wb") as f:
            f.write(data)


@pytest.mark.parametrize("save_last", [True, "link"])
def test_crafted_callback_state_never_deletes_outside_dirpath(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                              save_last: Any) -> None:
    monkeypatch.chdir(tmp_path)
    victims = {"victim.ckpt": b"victim", os.path.join("elsewhere", "abs.ckpt"): b"absolute",
               os.path.join("linked", "escaped.ckpt"): b"escaped"}
    for path, content in victims.items():
        _plant(tmp_path / path, content)

    def callback() -> OrtCheckpoint:
        return OrtCheckpoint(dirpath="ckpts", monitor="val_loss", save_top_k=2, save_last=save_last,
                             every_n_train_steps=2, keep_newest=1)

    vals = [9.0, 8.0, 7.0, 6.0, 5.0]  # each validation better: the top 2 rotates at every epoch
    _fit(callback(), 1, vals)
    os.symlink(tmp_path / "linked", tmp_path / "ckpts" / "sub")  # a folder inside ckpts leading out of it
    source = str(tmp_path / "ckpts" / name(0, 4))
    checkpoint = read_lightning_checkpoint(source)
    (key,) = [k for k in checkpoint["callbacks"] if k.startswith("OrtCheckpoint")]
    dotdot, absolute, escaped = ("ckpts/../victim.ckpt", str(tmp_path / "elsewhere" / "abs.ckpt"),
                                 "ckpts/sub/escaped.ckpt")
    state = checkpoint["callbacks"][key]
    state.update(best_k_models={dotdot: torch.tensor(10.0), absolute: torch.tensor(11.0)},
                 kth_best_model_path=absolute, kth_value=torch.tensor(11.0), best_model_path=dotdot,
                 best_model_score=torch.tensor(10.0), last_model_path=escaped,
                 saved=[dotdot, absolute, escaped, source], last_unranked=dotdot)
    crafted = str(tmp_path / "crafted.ckpt")
    with pytest.warns(CheckpointWarning):  # written outside a Trainer: fine for Lightning, which is what resumes it
        OrtCheckpointIO().save_checkpoint(checkpoint, crafted)

    cb = callback()
    with pytest.warns(CheckpointWarning, match=r"never be deleted or linked") as record:
        trainer = _fit(cb, 5, vals, ckpt_path=crafted)
    message = next(str(w.message) for w in record if "never be deleted" in str(w.message))
    assert all(p in message for p in (dotdot, absolute, escaped))
    atomic.wait_for_cleanup()
    assert trainer.global_step == 5 * STEPS_PER_EPOCH
    # rotation did drop every crafted path from the ranking ...
    assert not {dotdot, absolute, escaped} & set(cb.best_k_models)
    assert os.path.dirname(cb.last_model_path) == str(tmp_path / "ckpts")
    # ... and deleted none of them, nor their .data
    for path, content in victims.items():
        for p, data in ((tmp_path / path, content), (tmp_path / (path + ".data"), content + b" data")):
            with open(p, "rb") as f:
                assert f.read() == data, p
    assert os.path.islink(tmp_path / "ckpts" / "sub")
    # inside ckpts, our own rotation went on: the top 2 and the newest file (the step-4 file, listed in the crafted
    # state and really ours, rotated out), last, and the first run's last.ckpt, which the crafted state does not name
    kept = set(os.listdir(tmp_path / "ckpts")) - {"sub"}
    assert kept == {name(3, 16), name(4, 20), os.path.basename(cb.last_model_path), "last.ckpt"}
