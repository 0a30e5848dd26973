"""Sharded checkpoints in one process (``_dcp_storage``): roundtrip, commit, damage, fsspec, failed saves.

The two-process cases (DTensor shards, resharding, memory) are in ``test_dcp_distributed.py``.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import os
import resource
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from lightning_ort_ckpt._dcp._dcp_storage import METADATA_NAME, is_sharded_checkpoint, load_sharded, save_sharded
from lightning_ort_ckpt.errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError
from lightning_ort_ckpt.format._store import store_for
from helpers.s3 import _Forward, _Proxy


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "state_dict": collections.OrderedDict([("layer.weight", torch.randn(8, 5, generator=g)),
                                               ("layer.bias", torch.randn(8, generator=g, dtype=torch.float64)),
                                               ("bn.num_batches_tracked", torch.tensor(7)),
                                               ("half", torch.randn(3, 3, generator=g).to(torch.bfloat16))]),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.randn(8, 5, generator=g)}},
                              "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0]}]}],
        "epoch": 3, "global_step": 400 + seed,
        "loops": {"fit_loop": {"state": {"a/b": [1, 2.5, None, "x"]}}},
        "hyper_parameters": {"nan": float("nan"), "tuple": (1, 2), "set": {3}},
    }


def _empty_like(state: dict) -> dict:
    return {"state_dict": {k: torch.zeros_like(v) for k, v in state["state_dict"].items()},
            "optimizer_states": [{"state": {0: {k: torch.zeros_like(v) for k, v in
                                                state["optimizer_states"][0]["state"][0].items()}}}]}


def _assert_same(a: dict, b: dict) -> None:
    for k, v in a["state_dict"].items():
        assert b["state_dict"][k].dtype == v.dtype
        assert torch.equal(b["state_dict"][k].view(torch.uint8) if v.dtype == torch.bfloat16 else b["state_dict"][k],
                           v.view(torch.uint8) if v.dtype == torch.bfloat16 else v), k
    for k, v in a["optimizer_states"][0]["state"][0].items():
        assert torch.equal(b["optimizer_states"][0]["state"][0][k], v)


def test_roundtrip_is_bitwise_and_returns_the_whole_tree(tmp_path: Path) -> None:
    state = _state()
    path = str(tmp_path / "epoch=3-step=400.ckpt")
    save_sharded(state, path)
    assert is_sharded_checkpoint(path)
    target = _empty_like(state)
    before = target["state_dict"]["layer.weight"]
    out = load_sharded(target, path)
    assert target["state_dict"]["layer.weight"] is before  # filled in place
    _assert_same(state, target)
    assert out["state_dict"]["layer.weight"] is before
    assert out["epoch"] == 3 and out["global_step"] == 400
    assert out["loops"] == {"fit_loop": {"state": {"a/b": [1, 2.5, None, "x"]}}}
    assert out["optimizer_states"][0]["param_groups"] == [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0]}]
    assert list(out["optimizer_states"][0]["state"]) == [0]  # int keys stay ints
    hp = out["hyper_parameters"]
    assert hp["tuple"] == (1, 2) and hp["set"] == {3} and hp["nan"] != hp["nan"]


def test_tensors_not_asked_for_come_back_when_saved_whole(tmp_path: Path) -> None:
    state = _state()
    path = str(tmp_path / "c.ckpt")
    save_sharded(state, path)
    out = load_sharded({}, path)
    assert torch.equal(out["state_dict"]["layer.bias"], state["state_dict"]["layer.bias"])
    assert torch.equal(out["optimizer_states"][0]["state"][0]["exp_avg"],
                       state["optimizer_states"][0]["state"][0]["exp_avg"])
    values = load_sharded({}, path, others=False)  # the values alone: no tensor read
    assert values["state_dict"]["layer.bias"] is None and values["optimizer_states"][0]["state"][0]["exp_avg"] is None
    assert values["global_step"] == out["global_step"]


def test_no_pickle_in_the_directory(tmp_path: Path) -> None:
    path = tmp_path / "c.ckpt"
    save_sharded(_state(), str(path))
    files = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
    assert files[0] == METADATA_NAME and len(files) == 2 and files[1].endswith(".odtc")
    for f in path.iterdir():
        head = f.read_bytes()[:2]
        assert head[:1] != b"\x80" and head != b"PK"  # neither a pickle nor torch's zip
    json.loads((path / METADATA_NAME).read_text())


def test_directory_without_metadata_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "c.ckpt"
    save_sharded(_state(), str(path))
    (path / METADATA_NAME).unlink()
    assert not is_sharded_checkpoint(str(path))
    assert not is_sharded_checkpoint(str(tmp_path / "missing"))
    (tmp_path / "file.ckpt").write_bytes(b"x" * 100)
    assert not is_sharded_checkpoint(str(tmp_path / "file.ckpt"))
    with pytest.raises(CorruptCheckpointError, match="no checkpoint.ort-meta"):
        load_sharded({}, str(path))


def test_damaged_metadata_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.ckpt"
    save_sharded(_state(), str(path))
    doc = json.loads((path / METADATA_NAME).read_text())
    doc["files"] = ["../../etc/passwd"]
    (path / METADATA_NAME).write_text(json.dumps(doc))
    assert not is_sharded_checkpoint(str(path))
    with pytest.raises(CorruptCheckpointError, match=METADATA_NAME.replace(".", r"\.") + ".*not a shard file"):
        load_sharded({}, str(path))


def test_damaged_shard_names_the_file(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "c.ckpt"
    save_sharded(state, str(path))
    shard = next(p for p in path.iterdir() if p.name.endswith(".odtc"))
    data = bytearray(shard.read_bytes())
    needle = state["state_dict"]["layer.weight"].numpy().tobytes()
    at = bytes(data).index(needle)
    data[at + 3] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError) as e:
        load_sharded(_empty_like(state), str(path))
    assert str(shard) in str(e.value) and "layer.weight" in str(e.value) and "damaged" in str(e.value)


def test_state_asking_for_an_unsaved_tensor_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "c.ckpt")
    save_sharded(_state(), path)
    with pytest.raises(CheckpointError, match="no tensor 'state_dict/other'"):
        load_sharded({"state_dict": {"other": torch.zeros(2)}}, path)
    with pytest.raises(CheckpointError, match=r"shape \[2\] here but \[8, 5\]"):
        load_sharded({"state_dict": {"layer.weight": torch.zeros(2)}}, path)


def test_memory_url_works() -> None:
    state = _state()
    path = f"memory://dcp-{uuid.uuid4().hex[:12]}/epoch=1.ckpt"
    save_sharded(state, path)
    assert is_sharded_checkpoint(path)
    target = _empty_like(state)
    out = load_sharded(target, path)
    _assert_same(state, target)
    assert out["global_step"] == 400
    save_sharded(_state(1), path)  # replaced: the old save's files go
    import fsspec

    fs = fsspec.filesystem("memory")
    assert len([f for f in fs.ls(path, detail=False) if f.endswith(".odtc")]) == 1
    assert load_sharded({}, path)["global_step"] == 401


def test_replacing_keeps_one_save_and_failed_save_keeps_the_previous(tmp_path: Path) -> None:
    path = tmp_path / "c.ckpt"
    save_sharded(_state(0), str(path))
    save_sharded(_state(1), str(path))
    shards = [p for p in path.iterdir() if p.name.endswith(".odtc") and not p.name.startswith(".")]
    assert len(shards) == 1
    bad = _state(2)
    bad["state_dict"]["z"] = torch.zeros(3, dtype=torch.complex32)  # the writer refuses it, after DCP planned it
    with pytest.raises(CheckpointSaveError, match="'state_dict/z@0'.*complex32") as e:
        save_sharded(bad, str(path))
    assert str(path) in str(e.value)
    target = _empty_like(_state(1))
    out = load_sharded(target, str(path))
    _assert_same(_state(1), target)
    assert out["global_step"] == 401
    assert [p for p in path.iterdir() if p.name.endswith(".odtc") and not p.name.startswith(".")] == shards


def test_colliding_keys_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointSaveError, match="same key"):
        save_sharded({"s": {0: torch.zeros(1), "0": torch.ones(1)}}, str(tmp_path / "c.ckpt"))
    assert not os.path.exists(tmp_path / "c.ckpt" / METADATA_NAME)


# -- a failed save leaves the path as it was (issue 30, F3) ------------------------------------------------------------
@contextlib.contextmanager
def _files_at_most(size: int) -> Iterator[None]:
    """Every write of this process past ``size`` bytes of a file fails (EFBIG), as a full disk fails it: the kernel's
    file size limit (``RLIMIT_FSIZE``), with its signal ignored so that the write returns the error."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_a_save_that_cannot_write_leaves_no_folder_and_the_next_keeps_the_name(tmp_path: Path) -> None:
    path = tmp_path / "epoch=0-step=3.ckpt"
    state = {"state_dict": {"w": torch.randn(256, 1024)}, "global_step": 3}  # 1 MiB: past the limit below
    with _files_at_most(64 << 10), pytest.raises(CheckpointSaveError) as e:
        save_sharded(state, str(path))
    assert str(path) in str(e.value)
    assert _visible(tmp_path) == []  # no empty epoch=0-step=3.ckpt/ for the next save to step around (-v1)
    save_sharded(state, str(path))
    assert _visible(tmp_path) == [path.name] and load_sharded({}, str(path))["global_step"] == 3


def test_a_failed_save_over_a_checkpoint_keeps_its_folder_and_files(tmp_path: Path) -> None:
    path = tmp_path / "c.ckpt"
    save_sharded({"state_dict": {"w": torch.ones(4)}, "global_step": 1}, str(path))
    before = _visible(path)
    with _files_at_most(64 << 10), pytest.raises(CheckpointSaveError):
        save_sharded({"state_dict": {"w": torch.randn(256, 1024)}, "global_step": 2}, str(path))
    assert _visible(path) == before and load_sharded({}, str(path))["global_step"] == 1


# -- a metadata upload whose answer is lost (issue 30, F5) -------------------------------------------------------------
class _LosingAnswers(_Forward):
    """Forwards as ``_Forward`` does, except that for the methods in ``server.losing`` on the metadata object it
    forwards the request to moto (the object is stored, or read) and then closes the connection unanswered: the
    client's request timed out after the server acted."""

    server: Any

    def _forward(self) -> None:
        if self.command not in self.server.losing or not self.path.split("?")[0].endswith("/" + METADATA_NAME):
            super()._forward()
            return
        body = self._body()
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "transfer-encoding")}
            upstream.request(self.command, self.path, body=body, headers=headers)
            upstream.getresponse().read()
        finally:
            upstream.close()
        self.server.failed.append(f"{self.command} {self.path}")
        self.close_connection = True

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


@pytest.fixture
def losing(proxy: _Proxy) -> _Proxy:
    proxy.RequestHandlerClass = _LosingAnswers
    proxy.losing = set()  # type: ignore[attr-defined]
    return proxy


def _s3_checkpoint(endpoint: str) -> tuple[str, dict[str, Any]]:
    options = {"key": "x", "secret": "y", "client_kwargs": {"endpoint_url": endpoint}}
    bucket = f"dcp-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", **options).mkdir(bucket)
    return f"s3://{bucket}/run/epoch=0-step=3.ckpt", options


def test_a_lost_answer_to_the_metadata_upload_is_read_back_and_the_save_stands(losing: _Proxy) -> None:
    path, options = _s3_checkpoint(losing.url)
    losing.losing = {"PUT"}  # type: ignore[attr-defined]
    state = _state()
    save_sharded(state, path, store=store_for(path, options))  # the upload "failed"; reading back shows it landed
    assert losing.failed and all(r.startswith("PUT ") for r in losing.failed)
    target = _empty_like(state)
    assert load_sharded(target, path, store=store_for(path, options))["global_step"] == 400
    _assert_same(state, target)


def test_a_metadata_upload_that_cannot_be_told_keeps_the_shards_it_names(losing: _Proxy) -> None:
    path, options = _s3_checkpoint(losing.url)
    losing.losing = {"PUT", "GET"}  # the answer is lost, and so is the read-back's
    state = _state()
    with pytest.raises(CheckpointSaveError, match="may have been stored all the same"):
        save_sharded(state, path, store=store_for(path, options))
    losing.losing = set()  # type: ignore[attr-defined]
    # the metadata landed: every shard it names is still there, so the folder is a whole checkpoint
    target = _empty_like(state)
    assert load_sharded(target, path, store=store_for(path, options))["global_step"] == 400
    _assert_same(state, target)


# -- staging for asynchronous sharded saves (issue 34) -----------------------------------------------------------------
def test_shard_staging_is_allocated_ahead_reused_and_a_copy() -> None:
    from lightning_ort_ckpt._dcp._dcp_staging import ShardStager

    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    stager = ShardStager()
    stager.prepare(lambda: (list(model.parameters()), [opt]))
    stager.arm([opt])
    try:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()  # Adam's state exists now: the memory is allocated (and touched) on a thread of its own
        stager._memory.join()
        ahead = {t.data_ptr() for spares in stager._memory.spares.values() for t in spares}
        assert len(ahead) == 2 + 2 * 3  # weight, bias, and each one's step, exp_avg, exp_avg_sq
        flat = {"w": model.weight, "m": opt.state[model.weight]["exp_avg"], "extra": torch.arange(3)}
        first = stager.stage(flat)
        assert {first["w"].data_ptr(), first["m"].data_ptr()} <= ahead  # the first save takes what was allocated
        assert torch.equal(first["w"], model.weight) and first["w"].data_ptr() != model.weight.data_ptr()
        with torch.no_grad():
            model.weight.add_(1.0)  # training goes on: the staged copy keeps the saved values
        assert not torch.equal(first["w"], model.weight)
        second = stager.stage(flat)
        assert all(second[k].data_ptr() == first[k].data_ptr() for k in flat)  # the same memory, save after save
        assert torch.equal(second["w"], model.weight)
    finally:
        stager.close()
