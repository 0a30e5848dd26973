"""The checkpoint registry (``_registry.scan``), without a Trainer: real files written by the plugin, real sharded
folders written by ``save_sharded``, on the local disk and on ``memory://``.

Checked: committed checkpoints come newest first by the step their own metadata records (a file's Lightning
metadata, a folder's metadata document), whatever the modification times say; a folder without its metadata is
half-written; anything else is foreign; a checkpoint's ``.data`` and a folder's own files are parts of one unit; a
damaged entry is committed with its problem; an entry that is no regular file (a FIFO, a socket) is foreign, with a
warning, and never stops the scan; sizes on request.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
import warnings
from pathlib import Path

import fsspec
import pytest
import torch

from lightning_ort_ckpt import OrtCheckpointIO
from lightning_ort_ckpt._dcp._dcp_storage import METADATA_NAME, save_sharded
from lightning_ort_ckpt._restore._registry import Kind, State, committed, half, scan
from lightning_ort_ckpt.errors import CheckpointWarning
from lightning_ort_ckpt.format._store import store_for


def _file(path: str, step: int, epoch: int = 0) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plugin outside a Trainer says what it cannot save
        OrtCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2) * step}, "global_step": step,
                                           "epoch": epoch}, path)


def _folder(path: str, step: int, epoch: int = 0) -> None:
    save_sharded({"layer": {"weight": torch.ones(3, 4) * step}, "global_step": step, "epoch": epoch}, path)


@pytest.fixture(params=["local", "memory"])
def dirpath(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpts")
    url = f"memory://registry-{uuid.uuid4().hex[:12]}/ckpts"
    request.addfinalizer(lambda: fsspec.filesystem("memory").rm(url, recursive=True))
    return url


def test_newest_first_by_recorded_step_not_by_modification_time(tmp_path: Path) -> None:
    d = str(tmp_path)
    _file(f"{d}/epoch=1-step=8.ckpt", 8, 1)
    _folder(f"{d}/epoch=0-step=6.ckpt", 6)
    _file(f"{d}/epoch=0-step=2.ckpt", 2)
    future = time.time() + 3600  # the oldest step looks newest to anyone ordering by time
    os.utime(f"{d}/epoch=0-step=2.ckpt", (future, future))
    os.utime(f"{d}/epoch=0-step=6.ckpt", (future + 1, future + 1))
    entries = scan(d, store_for(d))
    assert [(os.path.basename(e.path), e.kind, e.step, e.epoch) for e in entries] == [
        ("epoch=1-step=8.ckpt", Kind.FILE, 8, 1), ("epoch=0-step=6.ckpt", Kind.FOLDER, 6, 0),
        ("epoch=0-step=2.ckpt", Kind.FILE, 2, 0)]
    assert all(e.state is State.COMMITTED and e.problem is None for e in entries)


def test_units_half_written_folders_and_foreign_files(dirpath: str) -> None:
    store = store_for(dirpath)
    fs, root = fsspec.core.url_to_fs(dirpath)
    _folder(f"{dirpath}/epoch=0-step=4.ckpt", 4)
    fs.makedirs(f"{root}/epoch=0-step=6.ckpt", exist_ok=True)  # a save that did not finish: shards, no metadata
    fs.pipe_file(f"{root}/epoch=0-step=6.ckpt/shard-0000000000000000-00000.odtc", b"shard" * 10)
    fs.pipe_file(f"{root}/notes.txt", b"mine")
    fs.pipe_file(f"{root}/epoch=0-step=4.ckpt/nested.ckpt", b"a file inside a checkpoint is part of it")
    entries = scan(dirpath, store, sizes=True)
    assert [(e.path, e.state) for e in entries] == [
        (f"{dirpath}/epoch=0-step=4.ckpt", State.COMMITTED), (f"{dirpath}/epoch=0-step=6.ckpt", State.HALF),
        (f"{dirpath}/notes.txt", State.FOREIGN)]
    assert [e.path for e in committed(entries)] == [f"{dirpath}/epoch=0-step=4.ckpt"]
    assert [e.path for e in half(entries)] == [f"{dirpath}/epoch=0-step=6.ckpt"]
    assert entries[0].size == sum(fs.size(p) for p in fs.find(f"{root}/epoch=0-step=4.ckpt")) > 0
    assert entries[2].size == 4


def test_a_file_with_its_data_is_one_entry_and_a_link_ranks_before_its_target(tmp_path: Path) -> None:
    d = str(tmp_path)
    _file(f"{d}/step=3.ckpt", 3)
    Path(f"{d}/step=3.ckpt.data").write_bytes(b"")  # (an empty companion stands in for external data here)
    os.symlink("step=3.ckpt", f"{d}/last.ckpt")
    entries = scan(d, store_for(d))
    assert [(os.path.basename(e.path), e.link, e.step) for e in entries] == [("last.ckpt", True, 3),
                                                                            ("step=3.ckpt", False, 3)]


def test_damaged_entries_are_committed_with_their_problem(tmp_path: Path) -> None:
    d = str(tmp_path)
    _folder(f"{d}/a.ckpt", 2)
    Path(d, "a.ckpt", METADATA_NAME).write_text("{}")
    Path(d, "b.ckpt").write_bytes(b"\0\0\0\0ODTC" + b"\xff" * 40)  # our identifier, then garbage
    entries = {os.path.basename(e.path): e for e in scan(d, store_for(d))}
    assert entries["a.ckpt"].state is State.COMMITTED and entries["a.ckpt"].step is None
    assert entries["a.ckpt"].problem == f"a checkpoint folder whose {METADATA_NAME} is damaged"
    assert entries["b.ckpt"].problem and entries["b.ckpt"].step is None


def test_remote_files_are_not_downloaded_to_be_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a store, a file's step would need a download: unknown (None), after the entries whose step is known."""
    dirpath = f"memory://registry-{uuid.uuid4().hex[:12]}/ckpts"
    _file(f"{dirpath}/step=2.ckpt", 2)
    _folder(f"{dirpath}/step=4.ckpt", 4)
    store = store_for(dirpath)
    fetched: list[str] = []
    real = type(store).fetched

    def counting(self: object, path: str) -> object:
        fetched.append(path)
        return real(self, path)  # type: ignore[arg-type]

    monkeypatch.setattr(type(store), "fetched", counting)
    try:
        entries = scan(dirpath, store)
    finally:
        fsspec.filesystem("memory").rm(dirpath, recursive=True)
    assert [(os.path.basename(e.path), e.step) for e in entries] == [("step=4.ckpt", 4), ("step=2.ckpt", None)]
    assert fetched == [f"{dirpath}/step=4.ckpt/{METADATA_NAME}"]  # the folder's metadata only


def test_a_fifo_or_socket_named_like_a_checkpoint_is_foreign_and_the_scan_goes_on(tmp_path: Path) -> None:
    """Issue 40: one odd entry never stops the listing that "last", retention and ``ls`` rely on."""
    d = str(tmp_path)
    _file(f"{d}/step=2.ckpt", 2)
    os.mkfifo(f"{d}/pipe.ckpt")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(f"{d}/sock.ckpt")
    try:
        with pytest.warns(CheckpointWarning) as caught:
            entries = scan(d, store_for(d))
    finally:
        sock.close()
    assert [(os.path.basename(e.path), e.state) for e in entries] == [
        ("step=2.ckpt", State.COMMITTED), ("pipe.ckpt", State.FOREIGN), ("sock.ckpt", State.FOREIGN)]
    assert entries[0].step == 2 and entries[0].problem is None
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2 and all("not a regular file" in m and "skipped" in m for m in messages), messages
    assert f"{d}/pipe.ckpt" in messages[0] and f"{d}/sock.ckpt" in messages[1], messages
