"""Fixtures several test modules share."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.format._atomic import _lock
from lightning_ort_ckpt.format._platform import PORTABLE_IO_ENV, portable_io
from test_callback import files_after_fit, fit, name


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sound checkpoint of a real Trainer (epoch 0, step 4), written by the real plugin."""
    d = tmp_path_factory.mktemp("good")
    fit(OrtCheckpoint(dirpath=d), 1)
    assert files_after_fit(d) == {name(0, 4)}
    return d / name(0, 4)


@pytest.fixture(params=["native", "portable"])
def io_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both I/O paths of the format layer: this platform's, by feature detection, and the portable one (plain reads
    and writes, fsync and rename, every Linux-only trick off: ``LIGHTNING_ORT_CKPT_PORTABLE_IO=1``). A test that
    asks for it runs on each (its child processes inherit the environment)."""
    if request.param == "portable":
        monkeypatch.setenv(PORTABLE_IO_ENV, "1")
        assert portable_io()
        # Without pid probing, the lock file of a writer the crash tests SIGKILL mid-commit is taken over only once
        # it is LOCK_STALE_S old (2 minutes; test_concurrency tests that rule): here, after 2 s.
        monkeypatch.setattr(_lock, "LOCK_STALE_S", 2.0)
    else:
        monkeypatch.delenv(PORTABLE_IO_ENV, raising=False)
        assert not portable_io()
    return request.param
