"""Fixtures several test modules share, and the markers each test file's tests carry (the tiers of
docs/testing.md)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.format._atomic import _lock
from lightning_ort_ckpt.format._local_store import LocalStore
from lightning_ort_ckpt.format._platform import PORTABLE_IO_ENV, portable_io
from helpers.fits import files_after_fit, fit, name
from helpers.s3 import counted, proxy, s3_endpoint  # noqa: F401 (fixtures: moto's S3 server, a proxy before it)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sound checkpoint of a real Trainer (epoch 0, step 4), written by the real plugin."""
    d = tmp_path_factory.mktemp("good")
    fit(OrtCheckpoint(dirpath=d), 1)
    assert files_after_fit(d) == {name(0, 4)}
    return d / name(0, 4)


@pytest.fixture
def memory_folder(tmp_path: Path) -> Iterator[Path]:
    """A new folder on a memory file system (``/dev/shm``, where a fast tier usually lives), removed afterwards."""
    if LocalStore().in_memory("/dev/shm/x"):
        folder = Path(tempfile.mkdtemp(prefix=f"{tmp_path.name}-", dir="/dev/shm"))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    else:  # (not Linux: no test here depends on it but those that say so)
        pytest.skip("no memory file system at /dev/shm")


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


# -- markers by file (docs/testing.md): what a file's tests need, so that a developer can choose a tier ----------------
# unit: no Trainer, no Fabric (the format layer, stores, translation, the CLI on files made in code);
# trainer: real Lightning Trainers or Fabric in the test process; multiprocess: rank launchers (2+ processes that
# import torch and Lightning, gloo on loopback); crash: processes killed mid-save; ort: the real ONNX Runtime as the
# judge; s3: moto's S3 server on 127.0.0.1; slow: big models (memory measurements), the examples, the packaging.
# A file not listed is "trainer". fast: the fast tier (`pytest -m fast`, under 3 minutes on 2 cores): the format
# layer, the stores, ORT interop, the CLI, the callback, resume, the save decision, staging, export checks, and the
# `smoke` tests (test_integration: a Trainer end to end, the CLI, the public names).
FILE_MARKERS: dict[str, tuple[str, ...]] = {
    "test_corrupt_input.py": ("unit", "fast"),
    "test_diskio.py": ("unit", "fast"),
    "test_portable_io.py": ("unit", "fast"),
    "test_roundtrip.py": ("unit", "fast"),
    "test_schema.py": ("unit", "fast"),
    "test_store_interface.py": ("unit", "fast"),
    "test_ort_interop.py": ("unit", "ort", "fast"),
    "test_cli.py": ("unit", "fast"),
    "test_cli_escapes.py": ("unit",),
    "test_deprecations.py": ("unit",),
    "test_fifo.py": ("unit",),
    "test_concurrency.py": ("unit", "multiprocess"),
    "test_consolidate.py": ("unit", "ort"),
    "test_crash_safety.py": ("unit", "crash"),
    "test_atomic_limits.py": ("unit", "crash"),
    "test_dcp_storage.py": ("unit", "s3"),
    "test_dcp_public.py": ("unit", "multiprocess"),
    "test_dcp_distributed.py": ("unit", "multiprocess"),
    "test_save_memory.py": ("unit", "slow"),
    "test_checksums.py": ("trainer", "ort"),
    "test_callback.py": ("trainer", "ort", "fast"),
    "test_callback_crash.py": ("trainer", "crash"),
    "test_preemption.py": ("trainer", "crash"),
    "test_frozen_sharing.py": ("trainer", "ort", "crash"),
    "test_healing.py": ("trainer", "ort"),
    "test_sharing_redundancy.py": ("trainer", "ort"),
    "test_sharded_strategies.py": ("trainer", "multiprocess", "ort"),
    "test_plugin_alone.py": ("trainer", "multiprocess", "ort"),
    "test_ddp.py": ("trainer", "multiprocess", "ort"),
    "test_multi_rank.py": ("trainer", "multiprocess"),
    "test_sharded_resume.py": ("trainer", "multiprocess", "s3"),
    "test_tiers_peer.py": ("trainer", "multiprocess", "s3"),
    "test_tiers_peer_sharded.py": ("trainer", "multiprocess", "s3"),
    "test_tiers_peer_nodes.py": ("trainer", "multiprocess", "s3"),
    "test_remote_storage.py": ("trainer", "s3", "ort"),
    "test_failures_reported.py": ("trainer", "s3"),
    "test_lightning_ort_interop.py": ("trainer", "ort"),
    "test_fabric.py": ("trainer", "ort"),
    "test_device_roundtrip.py": ("trainer", "ort"),
    "test_export.py": ("trainer", "ort"),
    "test_export_checks.py": ("trainer", "ort", "fast"),
    "test_export_tied.py": ("trainer", "ort"),
    "test_zoo.py": ("trainer", "ort"),
    "test_zoo_third_party.py": ("trainer", "ort"),
    "test_resume.py": ("trainer", "fast"),
    "test_registry.py": ("trainer", "fast"),
    "test_save_decision.py": ("trainer", "fast"),
    "test_staging_ahead.py": ("trainer", "fast"),
    "test_async_overlap.py": ("trainer", "fast"),
    "test_memory.py": ("trainer", "slow"),
    "test_examples.py": ("trainer", "ort", "slow"),
    "test_packaging.py": ("trainer", "ort", "slow"),
    "test_mid_epoch.py": ("trainer", "fast"),
    "test_mid_epoch_processes.py": ("trainer", "multiprocess", "crash"),
    "test_extra_state.py": ("trainer", "fast"),
    "test_cli_truth.py": ("trainer", "ort"),
    "test_first_steps.py": ("trainer", "fast"),
    "test_resume_last.py": ("trainer",),
    "test_export_safetensors.py": ("trainer", "ort"),
    "test_export_runtime.py": ("trainer", "ort"),
    "test_wandb_logger.py": ("trainer",),
    "test_docs.py": ("trainer", "ort", "slow"),
    "test_public_surfaces.py": ("unit", "fast"),
    "test_atomic_fork.py": ("unit", "crash"),
    "test_tiers.py": ("trainer", "s3"),
    "test_tiers_signals.py": ("trainer", "crash"),
    "test_tiers_sharded.py": ("trainer", "multiprocess"),
    "test_nothing_global_ranks.py": ("trainer", "multiprocess"),
    "test_tiers_signals_sharded.py": ("trainer", "multiprocess"),
    "test_tiers_kills.py": ("trainer", "multiprocess", "crash"),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test gets its file's markers."""
    for item in items:
        for name in FILE_MARKERS.get(item.path.name, ("trainer",)):
            item.add_marker(name)
        if item.get_closest_marker("smoke") is not None:
            item.add_marker("fast")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a venv without it (scripts/deploy.sh) runs the tests alone
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``-n``), a file's tests run on one worker (its module fixtures run once), and every rank
    launcher's file on the same one, one launch at a time (each already fills both cores). pytest-xdist's own
    ``--dist loadgroup`` would read ``xdist_group`` marks, but with pytest 9 its renaming of the tests has no effect
    and the groups are silently ignored: the work units are named here from the test ids alone."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "launchers" if "multiprocess" in FILE_MARKERS.get(Path(path).name, ()) else path

    return ByFile(config, log)
