"""Sharded save and load per rank: ours (``save_sharded``/``load_sharded``: ODTC shard files, checksums, our
metadata) against DCP's own ``FileSystemWriter``/``FileSystemReader`` on the same state, in the same run.

Two processes (gloo on 127.0.0.1) each hold half of every tensor as a DTensor shard (``distribute_tensor`` over a
1-D mesh: what FSDP2 holds), ``--mb`` MiB of float32 in all. Each round saves with both (alternating which goes
first), then loads into fresh shards with both; the figure per rank is the median of ``--rounds`` rounds, timed
between barriers (so a rank's time includes waiting for the other: the collective the save needs). Files go to
``--dir`` (default: a temporary folder, the page cache warm). Run: ``python benchmarks/sharded_save.py --mb 256``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _worker(mb: int, rounds: int, directory: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_ort_ckpt._dcp_storage import load_sharded, save_sharded

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    n = 16
    rows = mb * (1 << 20) // 4 // 1024 // n
    state = {"state_dict": {f"layer{i}.weight": distribute_tensor(torch.randn(rows, 1024), mesh, [Shard(0)])
                            for i in range(n)}, "epoch": 1}
    fresh = {"state_dict": {k: distribute_tensor(torch.zeros(rows, 1024), mesh, [Shard(0)])
                            for k in state["state_dict"]}}

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    ours_dir, theirs_dir = os.path.join(directory, "ours.ckpt"), os.path.join(directory, "dcp")
    times: dict[str, list[float]] = {"ours save": [], "dcp save": [], "ours load": [], "dcp load": []}
    for r in range(rounds):
        saves = [("ours save", lambda: save_sharded(state, ours_dir)),
                 ("dcp save", lambda: dcp.save(state["state_dict"],
                                               storage_writer=dcp.FileSystemWriter(theirs_dir)))]
        loads = [("ours load", lambda: load_sharded(fresh, ours_dir)),
                 ("dcp load", lambda: dcp.load(fresh["state_dict"], storage_reader=dcp.FileSystemReader(theirs_dir)))]
        for name, fn in (saves if r % 2 == 0 else saves[::-1]) + (loads if r % 2 == 0 else loads[::-1]):
            times[name].append(timed(fn))
    shard_mb = mb / 2
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"rank {rank}: shard {shard_mb:.0f} MiB; save ours {med['ours save']:.3f} s, dcp {med['dcp save']:.3f} s "
          f"(x{med['ours save'] / med['dcp save']:.2f}); load ours {med['ours load']:.3f} s, dcp "
          f"{med['dcp load']:.3f} s (x{med['ours load'] / med['dcp load']:.2f})", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="MiB of float32 state in all (half per rank)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(args.mb), str(args.rounds), directory],
                                  env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                       "RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
                                       "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])})
                 for rank in range(2)]
        codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
