"""``fit(ckpt_path="last")`` and ``ort-ckpt ls`` over a run directory holding more than the run's own checkpoints,
with real Trainers and real files: an entry that is no regular file (a FIFO, a socket) named like a checkpoint is
foreign, skipped with a warning, and the run resumes from the valid checkpoint beside it (issue 40); ``ls`` lists
the run beside it. A newer checkpoint of another model is skipped like a damaged one, and the first fit of a run
says one line of ours (issue 42, point 6)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.errors import CheckpointError, CheckpointWarning
from helpers.cli import run_cli
from helpers.fits import Net, files_after_fit, fit, name


@pytest.fixture(autouse=True)
def _restore_seed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(variable, raising=False)


@pytest.mark.parametrize("odd", ["fifo", "socket"])
def test_resume_last_skips_an_entry_that_is_no_regular_file(tmp_path: Path, odd: str) -> None:
    fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 2)
    entry = tmp_path / "zz-odd.ckpt"
    sock = None
    if odd == "fifo":
        os.mkfifo(entry)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(entry))
    try:
        with pytest.warns(CheckpointWarning, match=re.escape(str(entry))):
            trainer = fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 3, ckpt_path="last")
        assert trainer.ckpt_path == str(tmp_path / name(1, 8))
        assert trainer.lightning_module.steps_run == 4 and trainer.global_step == 12
        assert files_after_fit(tmp_path) == {name(0, 4), name(1, 8), name(2, 12), entry.name}

        out = run_cli("ls", tmp_path)
        assert out.returncode == 0, out
        assert "Traceback" not in out.stderr, out.stderr
        for n in (name(0, 4), name(1, 8), name(2, 12)):
            assert n in out.stdout, out.stdout
        assert "3 checkpoint(s)" in out.stdout and "0 not valid" in out.stdout, out.stdout
    finally:
        if sock is not None:
            sock.close()


class WiderNet(Net):  # type: ignore[misc, valid-type]
    """Another model: its layer has three outputs where the run's has one."""

    def __init__(self, vals: list[float] | None = None, sleep: float = 0.0) -> None:
        super().__init__(vals, sleep)
        self.layer = nn.Linear(4, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x)[:, :1], y)


def test_resume_last_skips_a_newer_foreign_file_whose_weights_do_not_fit(tmp_path: Path) -> None:
    """Issue 42 point 6: a checkpoint of another model, newer than the run's own, is skipped like a damaged one
    with a warning saying why, instead of crashing fit in Lightning's load."""
    run, other = tmp_path / "run", tmp_path / "other"
    fit(OrtCheckpoint(dirpath=run, save_top_k=-1), 2)
    fit(OrtCheckpoint(dirpath=other, save_top_k=-1), 3, net_class=WiderNet)
    foreign = run / "foreign.ckpt"
    shutil.copy(other / name(2, 12), foreign)  # step 12: newer than the run's step 8
    with pytest.warns(CheckpointWarning, match=re.escape(f"{foreign} cannot be resumed from (its weights do not fit "
                                                         "the module being fit: 'layer.weight' is 3x4 in the file, "
                                                         "1x4 in the module (1 more differ))")):
        trainer = fit(OrtCheckpoint(dirpath=run, save_top_k=-1), 3, ckpt_path="last")
    assert trainer.ckpt_path == str(run / name(1, 8))
    assert trainer.lightning_module.steps_run == 4 and trainer.global_step == 12


def test_a_file_that_fits_is_not_judged_by_entries_the_module_lacks(tmp_path: Path) -> None:
    """Entries of the file that the module lacks are not judged when "last" is resolved (a module may build more
    layers in configure_model); the newest file is taken."""
    fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 1, net_class=ExtraNet)
    trainer = fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 2, ckpt_path="last", net_class=LaterNet)
    assert trainer.ckpt_path == str(tmp_path / name(0, 4))
    assert trainer.global_step == 8


class ExtraNet(Net):  # type: ignore[misc, valid-type]
    def __init__(self, vals: list[float] | None = None, sleep: float = 0.0) -> None:
        super().__init__(vals, sleep)
        self.extra = nn.Linear(2, 2)


class LaterNet(Net):  # type: ignore[misc, valid-type]
    """Builds its second layer in configure_model, as sharded models do: absent when "last" is resolved."""

    def configure_model(self) -> None:
        if not hasattr(self, "extra"):
            self.extra = nn.Linear(2, 2)


def test_none_resumable_is_one_line_per_checkpoint_then_one_hint(tmp_path: Path) -> None:
    """Issue 40 point 9: O1's error, for four damaged files, in six lines (it repeated a paragraph per file)."""
    fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 4)
    names = [name(epoch, 4 * (epoch + 1)) for epoch in range(4)]
    for n, keep in zip(names, (-1, 0, 64, 8)):
        path = tmp_path / n
        with open(path, "r+b") as f:
            f.truncate(keep if keep >= 0 else path.stat().st_size // 2)
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError) as raised:
        fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 5, ckpt_path="last")
    lines = str(raised.value).splitlines()
    assert lines[0] == f'{tmp_path}: ckpt_path="last": none of its 4 checkpoint(s) can be resumed from:', lines
    assert sorted(line.split(": ", 1)[0] for line in lines[1:5]) == [f"  {n}" for n in sorted(names)], lines
    assert all(len(line) <= 2 + max(map(len, names)) + 2 + 200 and line.split(": ", 1)[1] for line in lines[1:5])
    assert len(lines) == 6 and lines[5].startswith("Fix or remove them, or pass resume_fallback=\"scratch\""), lines


def test_the_first_fit_with_last_says_our_line_then_lightnings(tmp_path: Path) -> None:
    """Issue 42 point 6: an empty dirpath on the first ``fit(ckpt_path="last")``: our one line, naming the folder;
    Lightning then says its own (issue 40: nothing of Lightning's "last" resolution is wrapped any more to hush
    it; docs/callback.md says its hint to set ``save_last=True`` does not apply)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(OrtCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1), 1, ckpt_path="last")
    said = [str(w.message) for w in caught if "ckpt_path" in str(w.message) or "save_last" in str(w.message)]
    assert said[0] == f'ckpt_path="last": no checkpoint yet in {tmp_path / "ckpts"}, starting from step 0', said
    assert len(said) == 2 and said[1].startswith('.fit(ckpt_path="last") is set, but there is no last'), said
    assert trainer.ckpt_path is None and trainer.global_step == 4
