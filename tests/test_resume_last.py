"""``fit(ckpt_path="last")`` and ``ort-ckpt ls`` over a run directory holding more than the run's own checkpoints,
with real Trainers and real files: an entry that is no regular file (a FIFO, a socket) named like a checkpoint is
foreign, skipped with a warning, and the run resumes from the valid checkpoint beside it (issue 40); ``ls`` lists
the run beside it."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest

from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.errors import CheckpointWarning
from test_callback import files_after_fit, fit, name
from test_checksums import run_cli


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
