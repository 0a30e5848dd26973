"""The Store as the one interface: backends say which paths are theirs, ``store_for`` picks among the registered
ones (a new backend is a new class), the writer takes a store, and the path questions upper layers need are the
store's. Real stores only: the local disk and fsspec's in-memory file system."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_ort_ckpt.errors import CheckpointSaveError, CorruptCheckpointError
from lightning_ort_ckpt.format import CheckpointContents, load_checkpoint, save_checkpoint
from lightning_ort_ckpt.format import _store
from lightning_ort_ckpt.format._atomic import SaveFiles
from lightning_ort_ckpt.format._fsspec_store import FsspecStore
from lightning_ort_ckpt.format._local_store import LocalStore
from lightning_ort_ckpt.format._store import register, store_for


def small() -> CheckpointContents:
    return CheckpointContents(trainable={"w": np.arange(12, dtype=np.float32)})


@pytest.mark.parametrize(("path", "backend"), [("/tmp/run/a.ckpt", LocalStore), ("run/a.ckpt", LocalStore),
                                                ("file:///tmp/run/a.ckpt", LocalStore), (None, LocalStore),
                                                ("memory://run/a.ckpt", FsspecStore),
                                                ("s3://bucket/run/a.ckpt", FsspecStore)])
def test_each_backend_says_which_paths_are_its_own(path: str | None, backend: type) -> None:
    assert [b for b in _store.BACKENDS if b.handles(path)][:1] == [backend]
    assert isinstance(store_for(path), backend)


class _Recording(LocalStore):
    """A new backend: the local disk under paths that start with its prefix, remembering what it wrote."""

    prefix = ""
    written: list[str] = []

    @classmethod
    def handles(cls, path: str | os.PathLike[str] | None) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(cls.prefix)

    def writing(self, path: str, **kwargs: Any) -> AbstractContextManager[SaveFiles]:
        self.written.append(path)
        return super().writing(path, **kwargs)


def test_a_new_backend_is_a_new_class_registered_not_an_edit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_store, "BACKENDS", _store.BACKENDS)  # restored after the test
    monkeypatch.setattr(_Recording, "prefix", str(tmp_path / "mine"))
    monkeypatch.setattr(_Recording, "written", [])
    register(_Recording)
    mine, other = tmp_path / "mine" / "a.ckpt", tmp_path / "other" / "a.ckpt"
    assert isinstance(store_for(mine), _Recording) and type(store_for(other)) is LocalStore
    save_checkpoint(small(), mine, store=store_for(mine))
    save_checkpoint(small(), other, store=store_for(other))
    assert _Recording.written == [str(mine)]
    assert np.array_equal(load_checkpoint(mine).trainable["w"], small().trainable["w"])


def test_the_writer_takes_a_store_and_storage_options_are_deprecated(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_ort_ckpt.format import _deprecated

    monkeypatch.setattr(_deprecated, "_warned", set())  # it warns once per process: this test sees the first time
    url = f"memory://store-interface-{tmp_path.name}/a.ckpt"
    save_checkpoint(small(), url, store=store_for(url, {}))
    store = store_for(url)
    with store.fetched(url) as local:
        assert np.array_equal(load_checkpoint(local).trainable["w"], small().trainable["w"])
    with pytest.warns(FutureWarning, match=r"store=lightning_ort_ckpt\.format\.store_for\(path, storage_options\)"):
        save_checkpoint(small(), url, storage_options={})
    with pytest.raises(TypeError, match="not both"):
        save_checkpoint(small(), url, store=store, storage_options={})


@pytest.mark.parametrize("where", ["local", "memory"])
def test_path_questions_are_the_stores(tmp_path: Path, where: str) -> None:
    directory = str(tmp_path / "run") if where == "local" else f"memory://store-paths-{tmp_path.name}/run"
    store = store_for(directory)
    path = store.join(directory, "a.ckpt")
    assert path == (os.path.join(directory, "a.ckpt") if where == "local" else directory + "/a.ckpt")
    save_checkpoint(small(), path, store=store)
    assert store.exists(path) and not store.is_directory(path) and store.is_directory(directory)
    assert store.size(path) == len(store.read_head(path, 1 << 20)) > 0
    assert store.absolute(path) == (os.path.abspath(path) if where == "local" else path)
    assert store.contains(directory, path)
    hidden = store.temp_name(path)
    assert store.join(directory, os.path.basename(hidden)) == hidden and os.path.basename(hidden).startswith(".")
    store.check_file(path)  # a regular file: nothing to say
    store.remove(path)
    type(store).wait_for_cleanup()
    _store.wait_for_cleanup()
    assert not store.exists(path)


def test_a_fifo_is_refused_by_the_local_store_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.ckpt"
    os.mkfifo(fifo)
    store = store_for(str(fifo))
    for ask in (lambda: store.read_head(str(fifo), 8), lambda: store.check_file(str(fifo))):
        with pytest.raises(CorruptCheckpointError, match="not a regular file"):
            ask()
    assert store.read_head(str(tmp_path / "missing.ckpt"), 8) == b"" and store.read_head(str(tmp_path), 8) == b""
    store.check_file(str(tmp_path / "missing.ckpt"))
    store.check_file(str(tmp_path))


def test_a_store_says_whether_a_path_is_on_a_memory_file_system(memory_folder: Path) -> None:
    """What decides whether an asynchronous save copies its tensors first (``_async_saver``): read off the mount
    table for the local disk (a folder below a mount point, a space escaped in its name), never for a URL."""
    local = LocalStore()
    spaced = memory_folder / "a folder"
    spaced.mkdir()
    assert local.in_memory(str(memory_folder / "a.ckpt")) and local.in_memory(str(spaced / "b.ckpt"))
    assert not local.in_memory("/proc/self/a.ckpt")  # proc: not a memory file system for files
    assert not FsspecStore().in_memory("memory://run/a.ckpt")


def test_when_read_is_called_once_the_tensors_are_read_and_an_error_there_commits_nothing(tmp_path: Path) -> None:
    seen: list[bool] = []
    save_checkpoint(small(), tmp_path / "a.ckpt", when_read=lambda: seen.append((tmp_path / "a.ckpt").exists()))
    assert seen == [False]  # before the commit
    assert load_checkpoint(tmp_path / "a.ckpt").trainable["w"].tolist() == list(range(12))

    def refuse() -> None:
        raise ValueError("changed meanwhile")

    with pytest.raises(CheckpointSaveError, match="changed meanwhile.*previous checkpoint at this path.*unchanged"):
        save_checkpoint(small(), tmp_path / "b.ckpt", when_read=refuse)
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt"]  # nothing of b, no debris
