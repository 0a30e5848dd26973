"""Fixtures several test modules share."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_ort_ckpt import OrtCheckpoint
from test_callback import files_after_fit, fit, name


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sound checkpoint of a real Trainer (epoch 0, step 4), written by the real plugin."""
    d = tmp_path_factory.mktemp("good")
    fit(OrtCheckpoint(dirpath=d), 1)
    assert files_after_fit(d) == {name(0, 4)}
    return d / name(0, 4)
