"""A store is built once, where its location is first known, and passed down (issue 40): a plugin keeps one per
location for its lifetime, shared by its saves, removals and links and by its callback's listings and resumes; a
public entry point (``load``, an export, a CLI command) builds one per location for its call. Counted through a real
backend registered with ``format._store.register``: the local disk under one folder (a ``LocalStore`` subclass that
really stores), whose constructions are counted."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_ort_ckpt import OrtCheckpoint, OrtCheckpointIO, load
from lightning_ort_ckpt._command import _cli
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.export import export_safetensors
from lightning_ort_ckpt.format import CheckpointContents, save_checkpoint
from lightning_ort_ckpt.format import _store
from lightning_ort_ckpt.format._local_store import LocalStore
from lightning_ort_ckpt.format._store import register, store_for

from helpers.damage import damaged_copy
from helpers.fits import at_step, fit


class _Counting(LocalStore):
    """The local disk under ``root``: every store built for a path there is one of these, and counted."""

    root = ""
    built = 0

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(storage_options)
        _Counting.built += 1

    @classmethod
    def handles(cls, path: str | os.PathLike[str] | None) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)).startswith(cls.root)


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The counted folder (the backend registered for this test only)."""
    monkeypatch.setattr(_store, "BACKENDS", _store.BACKENDS)  # restored after the test
    monkeypatch.setattr(_Counting, "root", str(tmp_path / "run"))
    monkeypatch.setattr(_Counting, "built", 0)
    register(_Counting)
    (tmp_path / "run").mkdir()
    return tmp_path / "run"


def _built_by(action: Any) -> int:
    before = _Counting.built
    action()
    return _Counting.built - before


def test_a_plugin_builds_one_store_for_its_saves_removals_and_links(run: Path) -> None:
    plugin = OrtCheckpointIO()
    a, b, last = str(run / "a.ckpt"), str(run / "b.ckpt"), str(run / "last.ckpt")
    with pytest.warns(CheckpointWarning, match="not attached"):
        assert _built_by(lambda: plugin.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, a)) == 1  # one save
        assert _built_by(lambda: plugin.save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, b)) == 0  # kept
    assert _built_by(lambda: plugin.link(b, last)) == 0
    assert _built_by(lambda: plugin.remove_checkpoint(a)) == 0
    assert _built_by(lambda: plugin.load_checkpoint(last)) == 0
    plugin.teardown()
    assert sorted(os.listdir(run)) == ["b.ckpt", "last.ckpt"] and _Counting.built == 1
    alone = OrtCheckpointIO()
    assert _built_by(lambda: alone.remove_checkpoint(b)) == 1  # one removal
    alone.teardown()
    assert not (run / "b.ckpt").exists()


def test_a_fit_and_a_resume_from_last_that_falls_back_build_one_store_each(run: Path) -> None:
    assert _built_by(lambda: fit(OrtCheckpoint(dirpath=run, every_n_train_steps=1, keep_newest=2), 1)) == 1
    assert sorted(p for p in os.listdir(run) if not p.startswith(".")) == [at_step(3), at_step(4)]
    damaged_copy(run / at_step(4), run / at_step(4))  # the newest cannot be resumed: "last" falls back to step 3
    with pytest.warns(CheckpointWarning, match=rf"{at_step(4)} cannot be resumed from"):
        built = _built_by(lambda: fit(OrtCheckpoint(dirpath=run, every_n_train_steps=1, keep_newest=2), 2,
                                      ckpt_path="last"))
    assert built == 1  # the listing, the reads of both candidates, the load, the new saves and removals


def test_cli_verify_load_and_export_build_one_store_each(run: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = str(run / "a.ckpt")
    save_checkpoint(CheckpointContents(trainable={"w": np.arange(6, dtype=np.float32)}), path,
                    store=store_for(path))
    assert _built_by(lambda: _cli.main(["verify", path])) == 1 and capsys.readouterr().out.startswith("OK ")
    assert _built_by(lambda: _cli.main(["verify", str(run)])) == 1  # a run directory: listed, then each verified
    assert _built_by(lambda: load(path)) == 1
    assert _built_by(lambda: export_safetensors(path, str(tmp_path / "out.safetensors"))) == 1
