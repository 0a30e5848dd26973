"""Small public surfaces: ``artifacts`` says what it exports, ``OrtStorageWriter`` takes only DCP's and its own
documented settings, and every deprecation warns as the README's rule says (``FutureWarning``, once, naming a
public replacement, never a private module)."""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_ort_ckpt.artifacts as artifacts
from lightning_ort_ckpt.dcp import OrtStorageWriter

LIMIT_S = 120


def _defined_here(module: types.ModuleType) -> set[str]:
    return {name for name, value in vars(module).items() if not name.startswith("_")
            and (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module.__name__}


def test_artifacts_exports_its_entry_point_and_keeps_helpers_private() -> None:
    assert sorted(artifacts.__all__) == ["ArtifactsError", "TrainingArtifacts", "make_training_artifacts"]
    assert _defined_here(artifacts) == set(artifacts.__all__)


def test_artifacts_say_which_weights_do_not_fit_the_module_given(tmp_path: Path) -> None:
    checkpoint = tmp_path / "other.ckpt"
    torch.save({"state_dict": nn.Linear(5, 2).state_dict()}, checkpoint)
    with pytest.raises(artifacts.ArtifactsError, match=r"do not fit the Linear given \(size mismatch") as e:
        artifacts.make_training_artifacts(nn.Linear(3, 2), checkpoint, tmp_path / "out",
                                          example_input=torch.ones(1, 3))
    assert str(checkpoint) in str(e.value)
    assert not (tmp_path / "out").exists()


def test_the_storage_writer_takes_no_internal_tree() -> None:
    assert "tree" not in inspect.signature(OrtStorageWriter).parameters
    with pytest.raises(TypeError):
        OrtStorageWriter("x", tree={})  # type: ignore[call-arg]
