"""Checkpoints in remote storage through fsspec: a real S3 API (moto's server, started here on 127.0.0.1, spoken to
by s3fs) and ``memory://``.

- ``OrtCheckpoint(dirpath="s3://...")`` writes top-k and last files to the store (nothing to a local folder named
  ``s3:``), rotates old ones out, and ``fit(ckpt_path="last")`` resumes bit for bit like the uninterrupted run; so do
  asynchronous saves and ``save_last="link"`` (a copy on a store).
- ``load_from_checkpoint``, an explicit ``s3://`` ``ckpt_path``, ``ort-ckpt inspect/verify/export`` and ORT itself
  read what was stored; a missing object is our error naming the URL.
- A save that fails mid-upload (after parts were sent) leaves the previous object as it was and no upload pending;
  an upload of a checkpoint many blocks long holds about a block in memory, not the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import onnx
import pytest
import pytorch_lightning as pl
import torch

import lightning_ort_ckpt
from lightning_ort_ckpt import (BindCheckpointIO, CheckpointSaveError, CorruptCheckpointError, OrtCheckpoint,
                                OrtCheckpointIO)
from lightning_ort_ckpt.format import CheckpointContents, load_checkpoint
from lightning_ort_ckpt.format import save_checkpoint
from lightning_ort_ckpt.format._store import store_for, strip_protocol
from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
from helpers.ort_reference import assert_same_tensor, ort_api
from helpers.zoo_models import BATCH, ZOO, Entry
from helpers.cli import Net as CliNet
from helpers.s3 import _free_port, _s3_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = next(e for e in ZOO if e.name == "tied_transformer")  # dropout and shuffling: resume needs the RNG states
BLOCK = 5 << 20  # S3's smallest part size: uploads of more than this go multipart


# -- the S3 server ------------------------------------------------------------------------------------------------


@dataclass
class Store:
    """A fresh folder in one kind of storage, and the options that reach it."""

    root: str
    options: dict[str, Any]

    @property
    def fs(self) -> Any:
        return fsspec.core.url_to_fs(self.root, **self.options)[0]

    def url(self, name: str) -> str:
        return f"{self.root}/{name}"

    def names(self) -> list[str]:
        fs, path = fsspec.core.url_to_fs(self.root, **self.options)
        fs.invalidate_cache()
        return sorted(p[len(path) + 1:] for p in fs.find(path)) if fs.exists(path) else []

    def read(self, name: str) -> bytes:
        fs, path = fsspec.core.url_to_fs(self.url(name), **self.options)
        fs.invalidate_cache()
        return fs.cat_file(path)


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Store:
    """A fresh bucket. The storage options name the server; the environment does too, for what Lightning itself
    opens without options (``ckpt_path`` resolution) and for subprocesses."""
    for name, value in _s3_env(s3_endpoint).items():
        monkeypatch.setenv(name, value)
    options = {"key": "x", "secret": "y", "client_kwargs": {"endpoint_url": s3_endpoint}}
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", **options).mkdir(bucket)
    return Store(f"s3://{bucket}/run", options)


@pytest.fixture
def memory() -> Iterator[Store]:
    store = Store(f"memory://ckpt-{uuid.uuid4().hex[:12]}/run", {})
    yield store
    fs = fsspec.filesystem("memory")
    if fs.exists(store.root):
        fs.rm(store.root, recursive=True)


@pytest.fixture(params=["s3", "memory"])
def store(request: pytest.FixtureRequest) -> Store:
    return request.getfixturevalue(request.param)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run in an empty folder: a URL mistaken for a local path would show up there."""
    monkeypatch.chdir(tmp_path)
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)


def assert_nothing_local(tmp_path: Any) -> None:
    assert os.listdir(tmp_path) == [], f"written to the local disk: {os.listdir(tmp_path)}"


# -- training -----------------------------------------------------------------------------------------------------
def loader(entry: Entry) -> torch.utils.data.DataLoader:
    x, y = entry.data()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def fit(model: Any, callbacks: list[Any], ckpt_path: str | None = None, plugins: list[Any] = (),
        **limits: Any) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, plugins=list(plugins), deterministic=True,
                         **limits)
    trainer.fit(model, loader(ENTRY), ckpt_path=ckpt_path)
    return trainer


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert_same_tensor(actual[k], v, k)


# -- fit, rotate, resume ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fit_writes_newest_and_last_to_the_store_and_rotates_old_files_out(store: Store, async_save: bool,
                                                                          tmp_path: Any) -> None:
    callback = OrtCheckpoint(dirpath=store.root, filename="{step}", every_n_train_steps=1, keep_newest=2,
                             save_last=True, async_save=async_save, storage_options=store.options)
    model = ENTRY.build(0)
    fit(model, [callback], max_epochs=2)  # 8 steps: 8 saves, 6 of them rotated out
    assert store.names() == ["last.ckpt", "step=7.ckpt", "step=8.ckpt"]
    assert callback.last_model_path == store.url("last.ckpt")
    assert callback.best_model_path == store.url("step=8.ckpt")
    for name in ("last.ckpt", "step=8.ckpt"):  # the files hold the final weights, checksums verified on read
        url = store.url(name)
        assert_same_state(read_lightning_checkpoint(url, store=store_for(url, store.options))["state_dict"], state(model))
    assert_nothing_local(tmp_path)


def test_resume_from_last_in_the_store_is_bitwise_the_uninterrupted_run(store: Store, tmp_path: Any) -> None:
    straight = ENTRY.build(0)
    fit(straight, [], enable_checkpointing=False, max_epochs=3)

    first = ENTRY.build(0)
    fit(first, [OrtCheckpoint(dirpath=store.root, save_last=True, storage_options=store.options)], max_epochs=1)
    resumed = ENTRY.build(7)  # another seed: the checkpoint's weights and random states must win
    callback = OrtCheckpoint(dirpath=store.root, save_last=True, storage_options=store.options)
    trainer = fit(resumed, [callback], ckpt_path="last", max_epochs=3)
    assert trainer.ckpt_path == store.url("last.ckpt")
    assert trainer.global_step == straight.trainer.global_step == 12
    assert_same_state(state(resumed), state(straight))
    assert store.names() == ["epoch=2-step=12.ckpt", "last.ckpt"]  # the resumed-from epoch=0 file rotated out
    assert_nothing_local(tmp_path)


def test_file_urls_are_the_local_paths_they_name(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dirpath="file:///..."`` saves to that folder with the local disk's commit (ModelCheckpoint alone would make a
    folder named ``file:`` in the working directory), and ``ckpt_path="file:///..."`` resumes from it."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    callback = OrtCheckpoint(dirpath=f"file://{run}", filename="{step}", save_last=True)
    model = ENTRY.build(0)
    fit(model, [callback], max_epochs=1)
    assert callback.last_model_path == str(run / "last.ckpt")
    assert sorted(os.listdir(run)) == ["last.ckpt", "step=4.ckpt"] and not (tmp_path / "file:").exists()
    resumed = ENTRY.build(7)
    trainer = fit(resumed, [OrtCheckpoint(dirpath=f"file://{run}")], ckpt_path=f"file://{run}/last.ckpt",
                  max_epochs=2)
    assert trainer.global_step == 8 and not (tmp_path / "file:").exists()
    OrtCheckpointIO().link(f"file://{run}/step=4.ckpt", f"file://{run}/alias.ckpt")  # the plugin, called directly
    assert os.path.islink(run / "alias.ckpt") and not (tmp_path / "file:").exists()


def test_save_last_link_is_a_copy_in_the_store(store: Store) -> None:
    callback = OrtCheckpoint(dirpath=store.root, filename="{step}", every_n_train_steps=2, save_top_k=-1,
                             save_last="link", storage_options=store.options)
    model = ENTRY.build(0)
    fit(model, [callback], max_epochs=1)
    assert store.names() == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    assert store.read("last.ckpt") == store.read("step=4.ckpt")


def test_explicit_url_load_from_checkpoint_and_missing_objects(s3: Store) -> None:
    model = ENTRY.build(0)
    fit(model, [OrtCheckpoint(dirpath=s3.root, filename="end", storage_options=s3.options)], max_epochs=1)
    url = s3.url("end.ckpt")
    loaded = lightning_ort_ckpt.load_from_checkpoint(type(model), url)  # through the environment's S3 settings
    assert_same_state(state(loaded), state(model))

    resumed = ENTRY.build(3)
    trainer = fit(resumed, [BindCheckpointIO()], ckpt_path=url, plugins=[OrtCheckpointIO(storage_options=s3.options)],
                  enable_checkpointing=False, max_epochs=2)
    straight = ENTRY.build(0)
    fit(straight, [], enable_checkpointing=False, max_epochs=2)
    assert trainer.global_step == 8
    assert_same_state(state(resumed), state(straight))

    missing = s3.url("nope.ckpt")
    with pytest.raises(CorruptCheckpointError, match=f"^{missing}: no such checkpoint file"):
        read_lightning_checkpoint(missing, store=store_for(missing, s3.options))


def test_storage_options_alone_reach_the_store(s3: Store, monkeypatch: pytest.MonkeyPatch,
                                              request: pytest.FixtureRequest) -> None:
    """With the environment pointing elsewhere (a closed loopback port), the plugin's options (and those Lightning
    passes to one save) are what finds the server, for saving, reading and deleting."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore: no retries against the closed port
    type(s3.fs).clear_instance_cache()  # no file system object made with the server's endpoint is reused
    request.addfinalizer(type(s3.fs).clear_instance_cache)  # nor, later, one made with the closed port
    with pytest.raises(CheckpointSaveError):  # the check that this test means something: no options, no server
        save_checkpoint(big_checkpoint(1000, 0), s3.url("nowhere.ckpt"))
    model = ENTRY.build(0)
    trainer = fit(model, [BindCheckpointIO()], plugins=[OrtCheckpointIO(storage_options=s3.options)],
                  enable_checkpointing=False,
                  max_epochs=1)
    trainer.save_checkpoint(s3.url("a.ckpt"))
    trainer.strategy.checkpoint_io.storage_options = None
    trainer.save_checkpoint(s3.url("b.ckpt"), storage_options=s3.options)  # Lightning's per-save options
    assert s3.names() == ["a.ckpt", "b.ckpt"]
    for name in ("a.ckpt", "b.ckpt"):
        url = s3.url(name)
        assert_same_state(read_lightning_checkpoint(url, store=store_for(url, s3.options))["state_dict"], state(model))
    OrtCheckpointIO(storage_options=s3.options).remove_checkpoint(s3.url("a.ckpt"))
    assert s3.names() == ["b.ckpt"]


# -- the command line and ORT -------------------------------------------------------------------------------------
def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
                               **env}, timeout=300)


def test_cli_inspects_verifies_and_exports_a_checkpoint_in_s3(s3: Store, s3_endpoint: str, tmp_path: Any) -> None:
    model = ENTRY.build(0)
    fit(model, [OrtCheckpoint(dirpath=s3.root, filename="end", storage_options=s3.options)], max_epochs=1)
    url = s3.url("end.ckpt")
    env = _s3_env(s3_endpoint)
    inspected = run_cli("inspect", url, "--json", env=env)
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert report["file"] == url and list(report["files"]) == [url]
    assert report["totals"]["trainable"] == len([p for p in model.parameters()])  # tied: stored once

    verified = run_cli("verify", url, env=env)
    assert verified.returncode == 0 and verified.stdout.startswith(f"OK {url}:"), verified.stdout + verified.stderr

    output = str(tmp_path / "model.onnx")
    exported = run_cli("export", url, "--module", "helpers.zoo_models:TiedTransformer", "--output", output,
                       "--tolerance", "1e-4", env=env)
    assert exported.returncode == 0, exported.stderr
    meta = {p.key: p.value for p in onnx.load(output).metadata_props}
    assert meta["lightning_ort_ckpt.source_checkpoint"] == url

    broken = s3.url("broken.ckpt")
    s3.fs.pipe_file(strip_protocol(broken), s3.read("end.ckpt")[:-100])  # truncated upload by another tool
    invalid = run_cli("verify", broken, env=env)
    assert invalid.returncode == 1 and invalid.stderr.startswith(f"INVALID {broken}: "), invalid.stderr
    assert str(tmp_path) not in invalid.stderr  # the error names the URL, not the downloaded copy


def test_ort_loads_and_trains_from_a_file_downloaded_from_s3(s3: Store, tmp_path: Any) -> None:
    """A file stored with external data (``.data`` uploaded first) is, downloaded, a checkpoint ORT loads."""
    model = ENTRY.build(0)
    io = OrtCheckpointIO(external_data="params", storage_options=s3.options)
    fit(model, [OrtCheckpoint(dirpath=s3.root, filename="end")], plugins=[io], max_epochs=1)  # the plugin's options
    assert s3.names() == ["end.ckpt", "end.ckpt.data"]
    local = tmp_path / "end.ckpt"
    local.write_bytes(s3.read("end.ckpt"))
    (tmp_path / "end.ckpt.data").write_bytes(s3.read("end.ckpt.data"))
    ort = ort_api().CheckpointState.load_checkpoint(str(local))
    names = [name for name, _ in ort.parameters if name in model.state_dict()]
    assert "block.linear1.weight" in names
    for name in names:
        assert_same_tensor(torch.from_numpy(np.array(ort.parameters[name].data)), model.state_dict()[name], name)


# -- failures and memory ------------------------------------------------------------------------------------------
def big_checkpoint(nbytes: int, seed: int) -> CheckpointContents:
    rng = np.random.default_rng(seed)
    return CheckpointContents(trainable={"w": rng.standard_normal(nbytes // 4, dtype=np.float32)}, frozen={},
                      optimizer_groups={}, properties={})


def test_a_failed_upload_leaves_the_previous_object_and_nothing_pending(store: Store,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection breaks after two parts of the new file were sent: the upload is aborted."""
    url = store.url("x.ckpt")
    s3 = store.root.startswith("s3://")
    options = {**store.options, "default_block_size": BLOCK} if s3 else store.options
    save_checkpoint(big_checkpoint(1 << 20, 0), url, storage_options=options)
    before = store.read("x.ckpt")

    file_class = type(fsspec.core.url_to_fs(url, **options)[0].open(strip_protocol(url), "rb"))
    original, sent = file_class.write, []

    def write(self: Any, data: Any) -> int:
        if self.tell() > 2 * BLOCK:
            raise ConnectionResetError("the connection broke mid-upload")
        sent.append(len(data))
        return original(self, data)

    monkeypatch.setattr(file_class, "write", write)
    with pytest.raises(CheckpointSaveError, match=f"^{url}: save failed .*the connection broke mid-upload"):
        save_checkpoint(big_checkpoint(4 * BLOCK, 1), url, storage_options=options)
    monkeypatch.undo()
    assert sum(sent) > 2 * BLOCK  # it broke while the file was being sent
    assert store.read("x.ckpt") == before
    assert store.names() == ["x.ckpt"]  # no partial object, no temporary
    if s3:
        bucket = strip_protocol(store.root).split("/")[0]
        assert store.fs.list_multipart_uploads(bucket) == []  # aborted, not left to linger (and be billed)
    assert_same_tensor(torch.from_numpy(read_checkpoint(url, options).trainable["w"].numpy()),
                       torch.from_numpy(big_checkpoint(1 << 20, 0).trainable["w"]), "w")


def test_a_pair_broken_between_its_two_uploads_is_a_loud_error_not_other_weights(s3: Store,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """External data: both uploads stream, ``.data`` is completed first. A failure while the main file streams
    completes neither: the previous pair is unchanged. A failure completing the main file, after ``.data`` was
    completed, leaves the new ``.data`` beside the old main file: loading it is CorruptCheckpointError naming the URL,
    and the next save repairs it."""
    url = s3.url("pair.ckpt")
    save_checkpoint(big_checkpoint(1 << 20, 0), url, external_data="params", storage_options=s3.options)
    file_class = type(s3.fs.open(strip_protocol(url), "rb"))
    original_write, original_close = file_class.write, file_class.close

    def write(self: Any, data: Any) -> int:
        if not self.path.endswith(".data"):
            raise ConnectionResetError("the connection broke mid-upload")
        return original_write(self, data)

    monkeypatch.setattr(file_class, "write", write)
    with pytest.raises(CheckpointSaveError, match="the connection broke mid-upload.*previous checkpoint .* unchanged"):
        save_checkpoint(big_checkpoint(1 << 20, 1), url, external_data="params", storage_options=s3.options)
    monkeypatch.undo()
    assert_same_tensor(torch.from_numpy(read_checkpoint(url, s3.options).trainable["w"].numpy()),
                       torch.from_numpy(big_checkpoint(1 << 20, 0).trainable["w"]), "w")

    def close(self: Any) -> None:
        if not self.path.endswith(".data") and self.mode == "wb" and not self.closed:
            raise ConnectionResetError("the connection broke completing the upload")
        original_close(self)

    monkeypatch.setattr(file_class, "close", close)
    with pytest.raises(CheckpointSaveError, match="completing the upload.*new .data file was stored"):
        save_checkpoint(big_checkpoint(1 << 20, 1), url, external_data="params", storage_options=s3.options)
    monkeypatch.undo()
    assert s3.names() == ["pair.ckpt", "pair.ckpt.data"]
    with pytest.raises(CorruptCheckpointError, match=f"^{url}: .*checksum"):
        read_checkpoint(url, s3.options)
    save_checkpoint(big_checkpoint(1 << 20, 1), url, external_data="params", storage_options=s3.options)
    assert_same_tensor(torch.from_numpy(read_checkpoint(url, s3.options).trainable["w"].numpy()),
                       torch.from_numpy(big_checkpoint(1 << 20, 1).trainable["w"]), "w")


_KILLED_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    import s3fs
    from lightning_ort_ckpt.format import CheckpointContents
    from lightning_ort_ckpt.format import save_checkpoint

    url, endpoint, block = sys.argv[1], sys.argv[2], int(sys.argv[3])
    options = {"key": "x", "secret": "y", "client_kwargs": {"endpoint_url": endpoint}, "default_block_size": block}
    upload_chunk = s3fs.core.S3File._upload_chunk

    def slow_network(self, final=False):  # two parts go through, then the connection stalls: the kill comes now
        sent = upload_chunk(self, final)
        if len(self.parts or []) >= 2:
            print("two parts sent", flush=True)
            time.sleep(600)
        return sent

    s3fs.core.S3File._upload_chunk = slow_network
    w = np.random.default_rng(1).standard_normal(4 * block // 4, dtype=np.float32)
    save_checkpoint(CheckpointContents(trainable={"w": w}, frozen={}, optimizer_groups={}, properties={}), url,
                 storage_options=options)
""")


def test_a_killed_upload_leaves_the_previous_object(s3: Store, s3_endpoint: str) -> None:
    """SIGKILL mid-upload (a preempted machine past its grace period): nothing can abort the upload, and still the
    previous object is what readers get; the next save of the name completes normally."""
    url = s3.url("x.ckpt")
    save_checkpoint(big_checkpoint(1 << 20, 0), url, storage_options=s3.options)
    before = s3.read("x.ckpt")
    child = subprocess.Popen([sys.executable, "-c", _KILLED_SCRIPT, url, s3_endpoint, str(BLOCK)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT})
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line == "two parts sent\n", child.stderr.read()  # type: ignore[union-attr]
    finally:
        child.kill()
        child.communicate()
    assert s3.read("x.ckpt") == before
    assert s3.names() == ["x.ckpt"]
    bucket = strip_protocol(s3.root).split("/")[0]
    assert len(s3.fs.list_multipart_uploads(bucket)) == 1  # left to the bucket's lifecycle rule (see the guide)
    save_checkpoint(big_checkpoint(2 * BLOCK, 2), url, storage_options=s3.options)
    assert_same_tensor(torch.from_numpy(read_checkpoint(url, s3.options).trainable["w"].numpy()),
                       torch.from_numpy(big_checkpoint(2 * BLOCK, 2).trainable["w"]), "w")


def read_checkpoint(url: str, options: dict[str, Any]) -> CheckpointContents:
    with store_for(url, options).fetched(url) as local:
        return load_checkpoint(local)


_UPLOAD_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from lightning_ort_ckpt.format import CheckpointContents, load_checkpoint
    from lightning_ort_ckpt.format import save_checkpoint

    def hwm():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

    url, endpoint, nbytes, block = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    options = {"key": "x", "secret": "y", "client_kwargs": {"endpoint_url": endpoint},
               "default_block_size": block}
    tensors = {f"t{i}": np.full(nbytes // 8 // 4, i, dtype=np.float32) for i in range(8)}
    small = CheckpointContents(trainable={"w": np.ones(1000, np.float32)}, frozen={}, optimizer_groups={}, properties={})
    save_checkpoint(small, url + ".warmup", storage_options=options)  # the client, its pools and buffers: the baseline
    baseline = hwm()
    save_checkpoint(CheckpointContents(trainable=tensors, frozen={}, optimizer_groups={}, properties={}), url,
                 storage_options=options)
    print(json.dumps({"growth": hwm() - baseline}))
""")


def test_an_upload_holds_about_a_block_in_memory_not_the_checkpoint(s3: Store, s3_endpoint: str) -> None:
    nbytes = 256 << 20
    url = s3.url("big.ckpt")
    done = subprocess.run([sys.executable, "-c", _UPLOAD_SCRIPT, url, s3_endpoint, str(nbytes), str(BLOCK)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    growth = json.loads(done.stdout.splitlines()[-1])["growth"]
    assert s3.fs.size(strip_protocol(url)) > nbytes
    # a few blocks and writes in flight (30 MiB measured here for 128, 256 and 512 MiB uploads), whatever the
    # checkpoint's size; a buffer of the whole file would be 256 MiB
    assert growth < nbytes // 4, f"peak memory grew by {growth / 2**20:.0f} MiB for a {nbytes >> 20} MiB upload"


# -- the command line over an S3 run directory (issue 42, point 5) ------------------------------------------------
def test_verify_and_inspect_take_an_s3_run_directory(s3: Store, s3_endpoint: str) -> None:
    callback = OrtCheckpoint(dirpath=s3.root, monitor="val_loss", save_top_k=2, storage_options=s3.options)
    pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, callbacks=[callback],
               enable_progress_bar=False, enable_model_summary=False).fit(CliNet())
    names = sorted(n for n in s3.names() if n.endswith(".ckpt"))
    assert len(names) == 2, s3.names()
    env = _s3_env(s3_endpoint)
    out = run_cli("verify", s3.root, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "half-written" not in out.stdout + out.stderr and "checkpoint.ort-meta" not in out.stderr
    for name in names:
        assert f"OK {s3.url(name)}: " in out.stdout, out.stdout
    assert out.stdout.splitlines()[-1] == "verified 2 checkpoint(s): 2 OK, 0 INVALID"
    out = run_cli("inspect", s3.root, env=env)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "inspected 2 checkpoint(s): 2 readable, 0 failed"
    out = run_cli("ls", s3.root, env=env)
    assert out.returncode == 1 and "ort-ckpt ls lists a local directory" in out.stderr, out.stderr
