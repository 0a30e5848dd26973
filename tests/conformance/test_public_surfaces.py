"""Small public surfaces: ``artifacts`` says what it exports, ``OrtStorageWriter`` takes only DCP's and its own
documented settings, and every deprecation warns as the README's rule says (``FutureWarning``, once, naming a
public replacement, never a private module)."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import textwrap
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


def _warnings_of(code: str) -> list[str]:
    """The warnings ``code`` shows, run in a fresh interpreter (each deprecation warns once per process)."""
    done = subprocess.run([sys.executable, "-W", "default", "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=LIMIT_S)
    assert done.returncode == 0, done.stderr
    return [line.split(": ", 1)[1] for line in done.stderr.splitlines() if "Warning: " in line]


def test_save_checkpoint_storage_options_is_a_future_warning_naming_the_public_store_for(tmp_path: Path) -> None:
    warned = _warnings_of(f"""
        import numpy as np
        from lightning_ort_ckpt.format import CheckpointContents, load_checkpoint, save_checkpoint
        for name in ("a.ckpt", "b.ckpt"):
            path = {str(tmp_path)!r} + "/" + name
            save_checkpoint(CheckpointContents(trainable={{"w": np.ones(4, np.float32)}}), path, storage_options={{}})
            assert load_checkpoint(path).trainable["w"].tolist() == [1.0] * 4
    """)
    assert warned == ["FutureWarning: lightning_ort_ckpt.format.save_checkpoint(storage_options=...) is deprecated "
                      "since 0.4 and will be removed in 0.5: pass store=lightning_ort_ckpt.format.store_for(path, "
                      "storage_options)"]
    from lightning_ort_ckpt import format as fmt

    assert {"Store", "store_for"} <= set(fmt.__all__)


def test_no_deprecation_message_names_a_private_module(tmp_path: Path) -> None:
    """Every deprecated name and argument of the package, used once: each message names only public places."""
    warned = _warnings_of(f"""
        import numpy as np
        import lightning_ort_ckpt, lightning_ort_ckpt.format as fmt
        lightning_ort_ckpt.Checkpoint, fmt.Checkpoint
        import lightning_ort_ckpt.plugin, lightning_ort_ckpt.cli, lightning_ort_ckpt.format.atomic
        fmt.save_checkpoint(fmt.CheckpointContents(trainable={{"w": np.ones(2, np.float32)}}),
                            {str(tmp_path / "c.ckpt")!r}, storage_options={{}})
    """)
    assert len(warned) == 6 and all(w.startswith("FutureWarning: ") for w in warned), warned
    private = [w for w in warned if re.search(r"\blightning_ort_ckpt(\.\w+)*\._\w+", w)]
    assert private == []
