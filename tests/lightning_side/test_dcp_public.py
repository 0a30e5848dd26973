"""``lightning_ort_ckpt.dcp`` as a plain torch.distributed.checkpoint storage, without Lightning: the behaviours
PyTorch's own DCP tests check of ``FileSystemWriter``/``FileSystemReader`` (our own tests, written for our classes),
and differential checks against DCP's own writer on the same state.

One process for most (DCP's ``no_dist``); two gloo processes on 127.0.0.1 (this file is their script, with a bounded
timeout) for a DTensor save loaded at world size 1 and for ``use_collectives=False``.
"""

from __future__ import annotations

import copy
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict, _load_state_dict_from_keys
from torch.distributed.checkpoint.stateful import Stateful

from lightning_ort_ckpt.dcp import OrtStorageReader, OrtStorageWriter
from lightning_ort_ckpt.errors import CheckpointSaveError, CorruptCheckpointError

_TIMEOUT_S = 600

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(state: dict[str, Any], path: Path, **writer: Any) -> None:
    dcp.save(state, storage_writer=OrtStorageWriter(path, **writer))


def _load(state: dict[str, Any], path: Path) -> None:
    dcp.load(state, storage_reader=OrtStorageReader(path))


def _rich_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4, generator=g)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "blob": b"\x00\x01raw", "io": io.BytesIO(b"abc"),
            "step": 7, "tags": ["a", ("b", 2)], "half": torch.randn(3, 2, generator=g).to(torch.bfloat16)}


# -- bytes and values (DCP's BYTE_IO items) ----------------------------------------------------------------------------
def test_bytes_and_bytesio_come_back_as_they_were(tmp_path: Path) -> None:
    _save({"bytes": b"some bytes", "empty": b"", "bytesio": io.BytesIO(b"in a buffer")}, tmp_path / "c")
    state: dict[str, Any] = {"bytes": None, "empty": None, "bytesio": None}
    _load(state, tmp_path / "c")
    assert state["bytes"] == b"some bytes" and state["empty"] == b""
    assert isinstance(state["bytesio"], io.BytesIO) and state["bytesio"].getvalue() == b"in a buffer"


def test_tensor_and_blob_and_only_tensor(tmp_path: Path) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _save({"t": t, "blob": io.BytesIO(b"x" * 100)}, tmp_path / "both")
    state: dict[str, Any] = {"t": torch.zeros(3, 4), "blob": None}
    _load(state, tmp_path / "both")
    assert torch.equal(state["t"], t) and state["blob"].getvalue() == b"x" * 100
    _save({"t": t}, tmp_path / "tensor")
    only = {"t": torch.zeros(3, 4)}
    _load(only, tmp_path / "tensor")
    assert torch.equal(only["t"], t)


def test_optimizer_state_with_param_groups_round_trips(tmp_path: Path) -> None:
    saved = _rich_state()
    _save(saved, tmp_path / "c")
    state = _rich_state()  # the same structure, the tensors zeroed, the values changed
    for part in ("model", "optim"):
        for t in _tensors(state[part]):
            t.zero_()
    state["optim"]["param_groups"][0]["lr"] = 1.0
    state.update(blob=None, io=None, step=0, tags=None)
    _load(state, tmp_path / "c")
    _assert_equal(saved, state)


class _Counter(Stateful):
    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, False

    def state_dict(self) -> dict[str, Any]:
        return {"n": torch.tensor(self.n), "name": "counter"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n, self.loaded = int(state_dict["n"]), state_dict["name"] == "counter"


def test_stateful_objects_load_in_place_and_plain_values_are_replaced(tmp_path: Path) -> None:
    _save({"counter": _Counter(5), "plain": {"x": torch.ones(2), "note": "saved"}}, tmp_path / "c")
    counter, plain = _Counter(0), {"x": torch.zeros(2), "note": "fresh"}
    state = {"counter": counter, "plain": plain}
    _load(state, tmp_path / "c")
    assert state["counter"] is counter and counter.loaded and counter.n == 5
    assert torch.equal(plain["x"], torch.ones(2)) and state["plain"]["note"] == "saved"


# -- the whole metadata, as DCP's own writer gives it ------------------------------------------------------------------
def test_dcp_to_torch_save_gives_what_it_gives_for_dcps_own_writer(tmp_path: Path) -> None:
    state = _rich_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "theirs"))
    _save(_rich_state(), tmp_path / "ours")
    dcp_to_torch_save(tmp_path / "theirs", tmp_path / "theirs.pt")
    ours: dict[str, Any] = {}  # dcp_to_torch_save with our reader
    _load_state_dict(ours, storage_reader=OrtStorageReader(tmp_path / "ours"), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    theirs = torch.load(tmp_path / "theirs.pt", weights_only=False)
    assert "optim" in ours and "param_groups" in ours["optim"]  # nested keys, not flat dotted ones
    _assert_equal(theirs, ours)
    keys = ["model.weight", "optim.param_groups"]
    _assert_equal(_load_state_dict_from_keys(keys, checkpoint_id=tmp_path / "theirs"),
                  _load_state_dict_from_keys(keys, storage_reader=OrtStorageReader(tmp_path / "ours")))


def test_metadata_keeps_what_dcp_records(tmp_path: Path) -> None:
    t = torch.randn(2, 3).requires_grad_()
    dcp.save({"w": t, "b": b"x"}, storage_writer=OrtStorageWriter(tmp_path / "c"))
    theirs = dcp.save({"w": t, "b": b"x"}, storage_writer=dcp.FileSystemWriter(tmp_path / "fs"))
    md = OrtStorageReader(tmp_path / "c").read_metadata()
    assert md.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    assert md.state_dict_metadata["w"].properties == theirs.state_dict_metadata["w"].properties
    assert md.state_dict_metadata["w"].properties.requires_grad
    assert md.planner_data == theirs.planner_data and md.version == dcp.FileSystemReader(tmp_path / "fs") \
        .read_metadata().version
    assert md.storage_meta is not None and md.storage_meta.checkpoint_id == str(tmp_path / "c")


# -- the storage's own choices: path, overwrite, validation --------------------------------------------------------------
def test_checkpoint_id_replaces_the_path_of_the_writer_and_reader(tmp_path: Path) -> None:
    writer = OrtStorageWriter(tmp_path / "a")
    dcp.save({"x": torch.ones(2)}, storage_writer=writer, checkpoint_id=tmp_path / "b")
    dcp.save({"x": torch.full((2,), 2.0)}, storage_writer=writer, checkpoint_id=tmp_path / "c")
    assert not (tmp_path / "a").exists()
    reader = OrtStorageReader(tmp_path / "a")
    for name, value in (("b", 1.0), ("c", 2.0)):
        state = {"x": torch.zeros(2)}
        dcp.load(state, storage_reader=reader, checkpoint_id=tmp_path / name)
        assert torch.equal(state["x"], torch.full((2,), value)), name


def test_overwrite_false_refuses_an_existing_checkpoint(tmp_path: Path) -> None:
    _save({"x": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(CheckpointException, match="overwrite=False"):
        _save({"x": torch.zeros(2)}, tmp_path / "c", overwrite=False)
    state = {"x": torch.zeros(2)}
    _load(state, tmp_path / "c")
    assert torch.equal(state["x"], torch.ones(2))
    _save({"x": torch.zeros(2)}, tmp_path / "new", overwrite=False)
    with pytest.raises(ValueError, match="thread_count"):
        OrtStorageWriter(tmp_path / "d", thread_count=0)


def test_overwrite_false_says_what_dcps_writer_says(tmp_path: Path) -> None:
    """Code written for ``FileSystemWriter`` recognises the refusal by DCP's words (PyTorch's e2e ``test_overwrite``
    matches "Checkpoint already exists"): both writers' refusals, side by side, carry them."""
    messages = []
    for name, writer in (("dcp", dcp.FileSystemWriter), ("ours", OrtStorageWriter)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's writer warns that overwrite's default will change
            dcp.save({"x": torch.ones(2)}, storage_writer=writer(tmp_path / name))
        with pytest.raises(CheckpointException) as refused:
            dcp.save({"x": torch.zeros(2)}, storage_writer=writer(tmp_path / name, overwrite=False))
        messages.append(str(refused.value))
    assert all("Checkpoint already exists" in m for m in messages), messages


def test_validate_checkpoint_id_knows_our_folders_from_others(tmp_path: Path) -> None:
    _save({"x": torch.ones(2)}, tmp_path / "ours")
    dcp.save({"x": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(tmp_path / "theirs"))
    (tmp_path / "file").write_bytes(b"not a folder")
    assert OrtStorageReader.validate_checkpoint_id(tmp_path / "ours")
    assert not OrtStorageReader.validate_checkpoint_id(tmp_path / "theirs")
    assert not OrtStorageReader.validate_checkpoint_id(tmp_path / "missing")
    assert not OrtStorageReader.validate_checkpoint_id(tmp_path / "file")
    assert OrtStorageWriter.validate_checkpoint_id(tmp_path / "ours")
    assert OrtStorageWriter.validate_checkpoint_id(tmp_path / "missing")
    assert not OrtStorageWriter.validate_checkpoint_id(tmp_path / "theirs")
    assert not OrtStorageWriter.validate_checkpoint_id(tmp_path / "file")


def test_no_pickle_and_every_tensor_checked(tmp_path: Path) -> None:
    _save({"w": torch.arange(64, dtype=torch.float32), "blob": b"bytes"}, tmp_path / "c")
    files = [p for p in (tmp_path / "c").iterdir() if not p.name.startswith(".")]
    for f in files:
        head = f.read_bytes()[:2]
        assert head[:1] != b"\x80" and head != b"PK", f  # neither a pickle nor torch's zip
    meta = json.loads((tmp_path / "c" / "checkpoint.ort-meta").read_text())
    assert meta["bytes"]["blob"]["kind"] == "bytes"
    shard = next(f for f in files if f.suffix == ".odtc")
    data = bytearray(shard.read_bytes())
    at = bytes(data).index(torch.arange(64, dtype=torch.float32).numpy().tobytes())
    data[at + 5] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as e:
        _load({"w": torch.zeros(64), "blob": None}, tmp_path / "c")
    failure = next(iter(e.value.failures.values()))
    assert isinstance(failure[0] if isinstance(failure, tuple) else failure, CorruptCheckpointError)


def test_async_save_with_our_writer_stages_into_reused_memory(tmp_path: Path) -> None:
    writer = OrtStorageWriter(tmp_path / "a")
    saved = _rich_state()
    future = dcp.async_save(saved, storage_writer=writer)
    expected = copy.deepcopy(saved)
    for t in _tensors(saved):
        t.add_(1)  # training goes on at once: the save holds its own copy
    saved["io"].write(b"more")
    future.result()
    first = {k: t.data_ptr() for k, (_, t) in writer._stager._memory.buffers.items()}
    dcp.async_save(saved, storage_writer=writer, checkpoint_id=tmp_path / "b").result()
    assert {k: t.data_ptr() for k, (_, t) in writer._stager._memory.buffers.items()} == first  # the same memory
    writer.close()
    for name, want in (("a", expected), ("b", saved)):
        state = _rich_state()
        state.update(blob=None, io=None)
        _load(state, tmp_path / name)
        _assert_equal(want, state, name)


def test_a_planner_that_cannot_hand_over_values_is_refused_not_pickled(tmp_path: Path) -> None:
    class OnlyResolves(dcp.DefaultSavePlanner):
        lookup_object = None  # type: ignore[assignment]

    with pytest.raises(CheckpointException) as e:
        dcp.save({"b": b"x"}, storage_writer=OrtStorageWriter(tmp_path / "c"), planner=OnlyResolves())
    assert "without pickle" in str(e.value)
    assert not OrtStorageReader.validate_checkpoint_id(tmp_path / "c")


# -- two processes ---------------------------------------------------------------------------------------------------
def _worker(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "col": distribute_tensor(full.T.contiguous(), mesh,
                                                                                      [Shard(1)]),
             "blob": b"rank zero's", "pg": [{"lr": 0.5, "params": [0]}]}
    dcp.save(state, storage_writer=OrtStorageWriter(os.path.join(out, "dtensor")))
    # no collectives: each rank its own state and its own metadata
    local = {"mine": torch.full((3,), float(rank)), "blob": f"rank {rank}".encode()}
    dcp.save(local, storage_writer=OrtStorageWriter(os.path.join(out, "local")), use_collectives=False)
    dist.barrier()
    back = {"mine": torch.zeros(3), "blob": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, storage_reader=OrtStorageReader(os.path.join(out, "local")))
    with open(os.path.join(out, f"local{rank}.json"), "w") as f:
        json.dump({"mine": back["mine"].tolist(), "blob": back["blob"].decode()}, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dcp-public")
    from helpers.launching import launch_ranks

    launch_ranks(Path(__file__), [str(out)], 2, _TIMEOUT_S, PYTHONWARNINGS="ignore")
    return out


def test_dtensor_shards_of_two_ranks_load_whole_in_one_process(two_ranks: Path) -> None:
    shards = sorted(p.name for p in (two_ranks / "dtensor").iterdir() if p.suffix == ".odtc")
    assert [n.rsplit("-", 1)[1] for n in shards] == ["00000.odtc", "00001.odtc"]
    full = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    state: dict[str, Any] = {"w": torch.zeros(10, 4), "col": torch.zeros(4, 10), "blob": None,
                             "pg": [{"lr": 0.0, "params": None}]}
    _load(state, two_ranks / "dtensor")
    assert torch.equal(state["w"], full) and torch.equal(state["col"], full.T)
    assert state["blob"] == b"rank zero's" and state["pg"] == [{"lr": 0.5, "params": [0]}]


def test_without_collectives_each_rank_keeps_its_own_files_and_metadata(two_ranks: Path) -> None:
    names = sorted(p.name for p in (two_ranks / "local").iterdir() if not p.name.startswith("."))
    assert "checkpoint.ort-meta" not in names  # no global metadata: DCP's rank-local layout
    assert [n for n in names if n.endswith(".ort-meta")] == ["rank-00000.ort-meta", "rank-00001.ort-meta"]
    assert sorted(n.rsplit("-", 1)[1] for n in names if n.endswith(".odtc")) == ["00000.odtc", "00001.odtc"]
    for rank in range(2):
        got = json.loads((two_ranks / f"local{rank}.json").read_text())
        assert got == {"mine": [float(rank)] * 3, "blob": f"rank {rank}"}


def test_a_save_without_collectives_over_a_global_checkpoint_is_refused(tmp_path: Path) -> None:
    _save({"x": torch.ones(2)}, tmp_path / "c")
    with pytest.raises(CheckpointSaveError, match="use_collectives=False"):
        dcp.save({"x": torch.zeros(2)}, storage_writer=OrtStorageWriter(tmp_path / "c"), use_collectives=False)


# -- helpers ---------------------------------------------------------------------------------------------------------
def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _assert_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _assert_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}/{i}")
    elif isinstance(a, io.BytesIO):
        assert isinstance(b, io.BytesIO) and a.getvalue() == b.getvalue(), where
    else:
        assert a == b, (where, a, b)


if __name__ == "__main__":
    _worker(sys.argv[1])
