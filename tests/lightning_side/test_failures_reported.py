"""Failures that must be reported, not lost (issue 25, items 6 to 8).

- An asynchronous save that fails while the program ends (no ``wait()``, no later save, no ``teardown``) is reported
  on stderr, naming the file and the error; every exit handler still runs and the exit status stays the program's
  (a library could change it only by skipping the interpreter's clean-up: ``_async_saver``'s docstring). One the
  program was told of (``wait()`` raised) is not reported twice.
- Retention's deletion of an old checkpoint that fails on S3 (HTTP 500 to ``DELETE``, from a proxy in front of moto)
  is a ``CheckpointWarning`` naming the URL, and training goes on; a save that fails the same way still raises.
- An S3 endpoint that refuses connections, or accepts them and never answers, fails a save with our error naming the
  URL within our connect and retry limits; the user's ``storage_options`` win over them, and no file system object
  other code holds is changed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np
import pytest
import pytorch_lightning as pl
import s3fs
import torch

from lightning_ort_ckpt import CheckpointSaveError, OrtCheckpoint
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.format import CheckpointContents, save_checkpoint
from lightning_ort_ckpt.format._fsspec_store import S3_LIMITS, S3FS_ATTEMPTS
from lightning_ort_ckpt.format._store import store_for
from helpers.s3 import _Proxy

HANG_GUARD_S = 300  # not a timing assertion: only "it did not stall for minutes" (the first save imports s3fs)


# -- 6: a failure at exit ------------------------------------------------------------------------------------------
def _run_script(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


_SAVE_AT_EXIT = """
    import atexit, logging, sys, torch
    from lightning_ort_ckpt import CheckpointSaveError, OrtCheckpointIO
    logging.basicConfig(filename=sys.argv[2], level=logging.INFO)
    atexit.register(print, "an earlier exit handler ran")
    io = OrtCheckpointIO(async_save=True)
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "epoch": 0}, sys.argv[1])
    atexit.register(print, "a later exit handler ran")
    logging.info("the program's last log line")
    if sys.argv[3] == "wait":
        try:
            io.wait()
        except CheckpointSaveError:
            print("the program was told")
    print("the program ended")
"""


def test_an_async_save_failing_at_exit_is_reported_on_stderr(tmp_path: Any) -> None:
    (tmp_path / "file").write_text("a regular file where the checkpoint's folder should be")
    path = str(tmp_path / "file" / "last.ckpt")
    result = _run_script(_SAVE_AT_EXIT, path, str(tmp_path / "log.txt"), "no-wait")
    assert result.returncode == 0, result.stderr
    report = [line for line in result.stderr.splitlines() if line.startswith("lightning-ort-ckpt:")]
    assert len(report) == 1, result.stderr
    assert "asynchronous checkpoint save failed and was never reported (CheckpointSaveError)" in report[0]
    assert path in report[0] and "save failed" in report[0]
    # the program's own output and exit handlers (registered before and after the save) all ran, once each
    assert result.stdout.splitlines() == ["the program ended", "a later exit handler ran",
                                          "an earlier exit handler ran"]
    assert (tmp_path / "log.txt").read_text() == "INFO:root:the program's last log line\n"


def test_an_async_failure_the_program_was_told_of_is_not_reported_again(tmp_path: Any) -> None:
    (tmp_path / "file").write_text("a regular file where the checkpoint's folder should be")
    result = _run_script(_SAVE_AT_EXIT, str(tmp_path / "file" / "last.ckpt"), str(tmp_path / "log.txt"), "wait")
    assert result.returncode == 0, result.stderr
    assert "lightning-ort-ckpt:" not in result.stderr
    assert result.stdout.splitlines() == ["the program was told", "the program ended", "a later exit handler ran",
                                          "an earlier exit handler ran"]


# -- 7: a failed DELETE on S3 --------------------------------------------------------------------------------------


def _bucket(endpoint: str) -> tuple[str, dict[str, Any]]:
    options = {"key": "x", "secret": "y", "client_kwargs": {"endpoint_url": endpoint}}
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", **options).mkdir(bucket)
    return f"s3://{bucket}/run", options


def _names(root: str, options: dict[str, Any]) -> list[str]:
    fs, where = fsspec.core.url_to_fs(root, **options)
    fs.invalidate_cache()
    return sorted(p[len(where) + 1:] for p in fs.find(where))


class _Small(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(12, 4, generator=g), torch.randn(12, 2, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_failed_deletion_on_s3_is_a_warning_naming_the_url_and_training_goes_on(proxy: _Proxy, async_save: bool,
                                                                                   tmp_path: Any) -> None:
    root, options = _bucket(proxy.url)
    proxy.failing = {"DELETE"}
    callback = OrtCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=1, keep_newest=1,
                             async_save=async_save, storage_options=options)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback], default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Small())
    assert trainer.global_step == 3  # every step trained, every save done
    failed = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)
              and "cannot delete" in str(w.message)]
    assert len(failed) == 2, [str(w.message) for w in caught]
    for step, message in zip((1, 2), failed):
        assert message.startswith(f"{root}/step={step}.ckpt: cannot delete it (")
        assert "injected by the test" in message
        assert message.endswith("the old checkpoint stays there, training goes on")
    assert proxy.failed and all(r.startswith("DELETE ") for r in proxy.failed)
    assert _names(root, options) == ["step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]  # nothing deleted, nothing lost
    assert callback.best_model_path == f"{root}/step=3.ckpt"


def test_a_save_failing_the_same_way_still_raises(proxy: _Proxy) -> None:
    root, options = _bucket(proxy.url)
    proxy.failing = {"PUT", "POST"}
    with pytest.raises(CheckpointSaveError, match=rf"^{root}/a\.ckpt: save failed \(.*injected by the test"):
        save_checkpoint(CheckpointContents(trainable={"w": np.ones(8, np.float32)}), f"{root}/a.ckpt",
                        storage_options=options)
    assert _names(root, options) == []


# -- 8: an endpoint that does not answer ---------------------------------------------------------------------------
@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A port bound on 127.0.0.1 but not listening: every connection is refused, and no other process takes it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts every connection and never says a word."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        held: list[socket.socket] = []

        def accept() -> None:
            with contextlib.suppress(OSError):
                while True:
                    held.append(s.accept()[0])

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        yield s.getsockname()[1]
        for c in held:
            c.close()


def _save_to(port: int, config_kwargs: dict[str, Any] | None = None) -> tuple[str, float]:
    url = f"s3://bucket-{uuid.uuid4().hex[:8]}/run/last.ckpt"
    options: dict[str, Any] = {"key": "x", "secret": "y", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
    if config_kwargs is not None:
        options["config_kwargs"] = config_kwargs
    start = time.monotonic()
    with pytest.raises(CheckpointSaveError) as raised:
        save_checkpoint(CheckpointContents(trainable={"w": np.ones(8, np.float32)}), url, storage_options=options)
    elapsed = time.monotonic() - start
    assert raised.value.path == url and str(raised.value).startswith(f"{url}: save failed (")
    return str(raised.value), elapsed


def test_an_s3_endpoint_that_refuses_fails_a_save_with_our_error_naming_the_url(refusing_port: int) -> None:
    message, elapsed = _save_to(refusing_port)
    assert "Could not connect to the endpoint URL" in message
    assert elapsed < HANG_GUARD_S, elapsed


def test_an_s3_endpoint_that_never_answers_fails_a_save_within_the_limits(silent_port: int) -> None:
    # the user's read timeout (1 s) wins over ours; our attempts bound how often it is waited for
    message, elapsed = _save_to(silent_port, {"read_timeout": 1})
    assert "Read timeout" in message
    assert elapsed < HANG_GUARD_S, elapsed


def test_the_limits_are_under_the_users_options_and_change_no_shared_file_system() -> None:
    options = {"key": "x", "secret": "y", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    shared = fsspec.filesystem("s3", **options)  # what other code in the process holds: fsspec caches it
    url = "s3://bucket/run/last.ckpt"

    fs, where = store_for(url, options)._fs(url)
    assert where == "bucket/run/last.ckpt"
    assert fs.config_kwargs == S3_LIMITS and fs.retries == S3FS_ATTEMPTS == 1
    assert S3_LIMITS == {"connect_timeout": 5, "read_timeout": 15,
                         "retries": {"mode": "standard", "total_max_attempts": 3}}  # as docs/guide.md says

    theirs = {**options, "config_kwargs": {"connect_timeout": 30, "retries": {"max_attempts": 9}}}
    fs, _ = store_for(url, theirs)._fs(url)
    assert fs.config_kwargs == {"connect_timeout": 30, "read_timeout": 15, "retries": {"max_attempts": 9}}

    assert fsspec.filesystem("s3", **options) is shared  # fsspec's cached instance is still the one handed out
    assert shared.config_kwargs == {} and shared.retries == 5 and s3fs.S3FileSystem.retries == 5
    assert fsspec.core.url_to_fs(url, **options)[0] is shared

    ours = store_for(url, options)._fs(url)[0]
    assert store_for(url, options)._fs(url)[0] is ours  # cached, as fsspec caches s3fs's
    s3fs.S3FileSystem.clear_instance_cache()  # what code does once the environment's endpoint changed: ours go too
    assert store_for(url, options)._fs(url)[0] is not ours

