"""Sharded checkpoints across two processes: FSDP2 (``fully_shard``) DTensor shards and their Adam state, saved at
world size 2 (gloo on 127.0.0.1), loaded at 2 (bitwise, shard by shard), at 1 and at 4 (the same full values,
resharded by torch.distributed.checkpoint's planner), and each
rank's peak memory during the save. The test starts the ranks itself (this file is their script) with a bounded
timeout."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

_TIMEOUT_S = 600
_WIDTH = 1536  # 4 layers of WIDTH x WIDTH float32: 36 MiB of weights, 18 MiB per rank, 54 MiB with Adam's state
_SLACK = 40 << 20  # what a rank's save may add to its memory: the writer's buffers, DCP's plans, the interpreter's


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(4)])


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _save_full(model: torch.nn.Module, opt: torch.optim.Optimizer, npz: str) -> None:
    """The whole module and optimizer state, gathered on every rank (a collective), written by rank 0."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    full_model, full_optim = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                                 cpu_offload=True))
    if dist.get_rank() == 0:
        full = {f"m/{k}": v.numpy() for k, v in full_model.items()}
        full.update({f"o/{p}/{k}": v.numpy() for p, s in full_optim["state"].items() for k, v in s.items()})
        np.savez(npz, **full)


def _worker(mode: str, path: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from lightning_ort_ckpt._dcp._dcp_storage import load_sharded, save_sharded

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0 if mode == "save" else 1)  # the loading run starts from other weights
    model = _model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if mode == "save":
        model(torch.randn(2, _WIDTH)).sum().backward()
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"state_dict": model_sd, "optimizer_states": [optim_sd], "epoch": 2, "global_step": 7 + rank}

    def local(sd: dict) -> dict[str, np.ndarray]:
        flat = {f"m/{k}": v for k, v in sd["state_dict"].items()}
        flat.update({f"o/{p}/{k}": v for p, s in sd["optimizer_states"][0]["state"].items() for k, v in s.items()})
        return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().numpy().copy() for k, v in flat.items()}

    if mode == "save":
        shard_bytes = sum(a.nbytes for a in local(state).values())
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
            f.write("5")
        before = _rss("VmRSS")
        save_sharded(state, path)
        grew = _rss("VmHWM") - before
        np.savez(f"{out}/local{rank}.npz", **local(state), grew=np.array(grew), shard=np.array(shard_bytes))
        _save_full(model, opt, f"{out}/full.npz")
    else:
        out_tree = load_sharded(state, path)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        if mode == "load":
            model_sd, optim_sd = get_state_dict(model, opt)
            np.savez(f"{out}/loaded{rank}.npz", **local({"state_dict": model_sd, "optimizer_states": [optim_sd]}),
                     global_step=np.array(out_tree["global_step"]))
        else:  # another world size: the whole state, gathered, is what was saved
            _save_full(model, opt, f"{out}/{mode}.npz")
    dist.barrier()
    dist.destroy_process_group()


def _run_ranks(mode: str, path: Path, out: Path, world_size: int = 2) -> None:
    from helpers.launching import launch_ranks

    launch_ranks(Path(__file__), [mode, str(path), str(out)], world_size, _TIMEOUT_S)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("dcp2")
    path = out / "epoch=2-step=7.ckpt"
    _run_ranks("save", path, out)
    return path, out


def test_each_rank_writes_its_shards_and_rank0_the_metadata(saved: tuple[Path, Path]) -> None:
    from lightning_ort_ckpt._dcp._dcp_storage import METADATA_NAME, is_sharded_checkpoint

    path, _ = saved
    assert is_sharded_checkpoint(str(path))
    names = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
    assert names[0] == METADATA_NAME
    assert [n.rsplit("-", 1)[1] for n in names[1:]] == ["00000.odtc", "00001.odtc"]


def test_save_memory_stays_at_the_shard(saved: tuple[Path, Path]) -> None:
    _, out = saved
    for rank in range(2):
        with np.load(out / f"local{rank}.npz") as f:
            grew, shard = int(f["grew"]), int(f["shard"])
        assert shard > 50 << 20
        assert grew < _SLACK, f"rank {rank}: the save added {grew >> 20} MiB to a {shard >> 20} MiB shard"


def test_load_at_world_size_2_is_bitwise(saved: tuple[Path, Path]) -> None:
    path, out = saved
    _run_ranks("load", path, out)
    for rank in range(2):
        with np.load(out / f"local{rank}.npz") as want, np.load(out / f"loaded{rank}.npz") as got:
            keys = [k for k in want.files if k not in ("grew", "shard")]
            assert len(keys) == 4 * 2 + 4 * 2 * 3
            for k in keys:
                assert want[k].tobytes() == got[k].tobytes(), (rank, k)
            assert int(got["global_step"]) == 7  # non-tensor values are rank 0's


def test_load_at_world_size_1_has_the_same_values(saved: tuple[Path, Path]) -> None:
    from lightning_ort_ckpt._dcp._dcp_storage import load_sharded

    path, out = saved
    with np.load(out / "full.npz") as f:
        full = {k: f[k] for k in f.files}
    state = {"state_dict": {k[2:]: torch.zeros(v.shape, dtype=torch.from_numpy(v).dtype)
                            for k, v in full.items() if k.startswith("m/")},
             "optimizer_states": [{"state": {}}]}
    for k, v in full.items():
        if k.startswith("o/"):
            param, name = k[2:].rsplit("/", 1)
            state["optimizer_states"][0]["state"].setdefault(param, {})[name] = torch.zeros(
                v.shape, dtype=torch.from_numpy(v).dtype)
    tree = load_sharded(state, str(path))
    assert tree["epoch"] == 2
    for k, v in full.items():
        if k.startswith("m/"):
            got = state["state_dict"][k[2:]]
        else:
            param, name = k[2:].rsplit("/", 1)
            got = state["optimizer_states"][0]["state"][param][name]
        assert got.numpy().tobytes() == v.tobytes(), k


def test_load_at_world_size_4_has_the_same_values(saved: tuple[Path, Path]) -> None:
    path, out = saved
    _run_ranks("load4", path, out, world_size=4)
    with np.load(out / "full.npz") as want, np.load(out / "load4.npz") as got:
        assert sorted(want.files) == sorted(got.files)
        for k in want.files:
            assert want[k].tobytes() == got[k].tobytes(), k


def test_consolidation_assembles_the_shards(saved: tuple[Path, Path]) -> None:
    from lightning_ort_ckpt import consolidate, load_checkpoint

    path, out = saved
    consolidate(path, out / "one.ckpt")
    got = load_checkpoint(out / "one.ckpt")
    with np.load(out / "full.npz") as f:
        for k in f.files:
            if k.startswith("m/"):
                assert got.trainable[k[2:]].numpy().tobytes() == f[k].tobytes(), k
            elif not k.endswith("/step"):
                param, name = k[2:].rsplit("/", 1)
                ort_name = {"exp_avg": "momentum0", "exp_avg_sq": "momentum1"}[name]
                assert got.optimizer_groups["group0"].states[param][ort_name].numpy().tobytes() == f[k].tobytes()


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
