"""First steps, each tried as a new user would (issue 42, point 6): a missing path is said to be missing, a wrong
``dirpath`` is named when the callback is made."""

from __future__ import annotations

from pathlib import Path

import pytest

import lightning_ort_ckpt
from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.errors import CheckpointConfigError, CheckpointError, CorruptCheckpointError


@pytest.mark.parametrize("where", ["local", "memory"])
def test_load_of_a_missing_path_says_missing_not_corrupt(tmp_path: Path, where: str) -> None:
    path = str(tmp_path / "missing.ckpt") if where == "local" else "memory://first-steps/missing.ckpt"
    with pytest.raises(CheckpointError) as raised:
        lightning_ort_ckpt.load(path)
    assert not isinstance(raised.value, CorruptCheckpointError)
    assert str(raised.value) == f"{path}: no such file or folder: nothing to load"


@pytest.mark.parametrize("dirpath", [123, 1.5, ["ckpts"]])
def test_a_dirpath_that_is_no_path_is_a_config_error_naming_it(dirpath: object) -> None:
    with pytest.raises(CheckpointConfigError, match=r"^dirpath must be a folder's path") as raised:
        OrtCheckpoint(dirpath=dirpath)  # type: ignore[arg-type]
    assert repr(dirpath) in str(raised.value)


def test_a_dirpath_given_as_a_path_object_is_taken(tmp_path: Path) -> None:
    assert OrtCheckpoint(dirpath=tmp_path / "ckpts").dirpath == str(tmp_path / "ckpts")
