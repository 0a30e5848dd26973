"""Sharded checkpoints in one process (``_dcp_storage``): roundtrip, commit, damage, fsspec, failed saves.

The two-process cases (DTensor shards, resharding, memory) are in ``test_dcp_distributed.py``.
"""

from __future__ import annotations

import collections
import json
import os
import uuid
from pathlib import Path

import pytest
import torch

from lightning_ort_ckpt._dcp_storage import METADATA_NAME, is_sharded_checkpoint, load_sharded, save_sharded
from lightning_ort_ckpt.errors import CheckpointError, CheckpointSaveError, CorruptCheckpointError


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
