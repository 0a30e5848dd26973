"""Sharded save and load per rank: ours (``save_sharded``/``load_sharded``: ODTC shard files, checksums, our
metadata; ``dcp.async_save`` with ``lightning_ort_ckpt.dcp.OrtStorageWriter``) against DCP's own
``FileSystemWriter``/``FileSystemReader`` (``dcp.save``, ``dcp.async_save``) on the same state, in the same run.

Two processes (gloo on 127.0.0.1) each hold half of every tensor as a DTensor shard (``distribute_tensor`` over a
1-D mesh: what FSDP2 holds), ``--mb`` MiB of float32 in all. Each round saves with each (alternating the order),
then loads into fresh shards with both; the figure per rank is the median of ``--rounds`` rounds, timed between
barriers (so a rank's time includes waiting for the other: the collective the save needs). For asynchronous saves,
"stall" is the time ``dcp.async_save`` takes to return (what the training step waits for: the staging copy) and
"total" the time until the save is written; their collectives run on a gloo group of their own. "Memory" is the
rank's peak resident memory during the save above what it held before (``VmHWM`` reset through
``/proc/self/clear_refs``): the staging copy, buffers. Ours keeps its staging memory from save to save, allocated
ahead of the first save (``OrtStorageWriter.allocate_staging``, untimed, as a training script calls it before its
loop; ``--no-ahead``: by the first save), so every copy goes into memory already there; DCP's ``FileSystemWriter``
allocates it each save. The first round's async stalls are printed apart, and each target is checked (issue 34:
async stall <= 1.2x DCP's ``async_save`` stall, sync save <= 1.2x DCP's, one staging copy of the shard at most).
Files go to ``--dir`` (default: a temporary folder); before each load both folders are put in the same page-cache
state (``--cache warm``, the default: read once; ``--cache cold``: dropped). Run:
``python benchmarks/sharded_save.py --mb 256``.
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
import warnings

from restore import set_cache  # (this folder: the benchmark is run as a script)


def _kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _prepare(folders: list[str], warm: bool) -> None:
    """Every byte of the files in ``folders`` in the page cache (``warm``), or none of them. Our saves leave their
    files uncached (write-behind) and DCP's leave them cached: without this, a load right after a save would read
    ours from the disk and DCP's from memory."""
    set_cache([os.path.join(folder, name) for folder in folders for name in sorted(os.listdir(folder))], warm)


def _worker(mb: int, rounds: int, directory: str, ahead: bool, cache: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_ort_ckpt._dcp._dcp_storage import load_sharded, save_sharded
    from lightning_ort_ckpt.dcp import OrtStorageWriter

    warnings.simplefilter("ignore")  # DCP's FileSystemWriter warns that it overwrites, every round
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

    ours_dir, theirs_dir = os.path.join(directory, "ours.ckpt"), os.path.join(directory, "dcp")
    group = dist.new_group(backend="gloo")  # the background saves' collectives, apart from the barriers'
    writer = OrtStorageWriter(os.path.join(directory, "ours-async"))
    if ahead:
        writer.allocate_staging(state["state_dict"])  # as training would, before its first save (untimed)
    stats: dict[str, list[tuple[float, float, int]]] = {}

    def run_async(make_writer) -> tuple[float, float]:
        start = time.perf_counter()
        future = dcp.async_save(state["state_dict"], storage_writer=make_writer(), process_group=group)
        stall = time.perf_counter() - start
        future.result()
        return stall, time.perf_counter() - start

    saves = [("ours save", lambda: (0.0, save_sharded(state, ours_dir))),
             ("dcp save", lambda: (0.0, dcp.save(state["state_dict"], storage_writer=dcp.FileSystemWriter(theirs_dir)))),
             ("ours async", lambda: run_async(lambda: writer)),
             ("dcp async", lambda: run_async(lambda: dcp.FileSystemWriter(theirs_dir + "-async")))]
    loads = [("ours load", lambda: (0.0, load_sharded(fresh, ours_dir))),
             ("dcp load", lambda: (0.0, dcp.load(fresh["state_dict"], storage_reader=dcp.FileSystemReader(theirs_dir))))]
    for r in range(rounds):
        for name, fn in (saves if r % 2 == 0 else saves[::-1]) + (loads if r % 2 == 0 else loads[::-1]):
            if name.endswith("load") and rank == 0:  # both folders in the same page-cache state (untimed)
                _prepare([ours_dir, theirs_dir], cache == "warm")
            dist.barrier()
            with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
                f.write("5")
            before = _kb("VmRSS")
            start = time.perf_counter()
            stall = fn()[0]
            dist.barrier()
            stats.setdefault(name, []).append((stall, time.perf_counter() - start,
                                               max(0, _kb("VmHWM") - before) >> 10))
    held = sum(t.numel() * t.element_size() for _, t in writer._stager._memory.buffers.values()) / 2**20
    writer.close()
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in stats.items()}
    shard_mb = mb / 2
    lines = [f"rank {rank}: shard {shard_mb:.0f} MiB; ours keeps {held:.0f} MiB of staging memory between async saves "
             f"({held / shard_mb:.2f} copies of the shard; target <= 1: {'met' if held <= shard_mb * 1.01 else 'NOT MET'})"
             f"{', allocated ahead (allocate_staging)' if ahead else ', allocated by the first save'}"]
    for kind in ("save", "async", "load"):
        ours, theirs = med[f"ours {kind}"], med[f"dcp {kind}"]
        line = f"  {kind:5s} total ours {ours[1]:.3f} s, dcp {theirs[1]:.3f} s (x{ours[1] / theirs[1]:.2f})"
        if kind == "async":
            line += f"; stall ours {ours[0] * 1e3:.1f} ms, dcp {theirs[0] * 1e3:.1f} ms (x{ours[0] / theirs[0]:.2f})"
        lines.append(line + f"; memory ours {ours[2]:.0f} MiB, dcp {theirs[2]:.0f} MiB")
    first = stats["ours async"][0][0], stats["dcp async"][0][0]
    stall_ratio = med["ours async"][0] / med["dcp async"][0]
    save_ratio = med["ours save"][1] / med["dcp save"][1]
    load_ratio = med["ours load"][1] / med["dcp load"][1]
    lines.append(f"  first async save: stall ours {first[0] * 1e3:.1f} ms, dcp {first[1] * 1e3:.1f} ms "
                 f"(x{first[0] / first[1]:.2f}); each round, ours: "
                 + ", ".join(f"{x[0] * 1e3:.1f}" for x in stats["ours async"]) + " ms; dcp: "
                 + ", ".join(f"{x[0] * 1e3:.1f}" for x in stats["dcp async"]) + " ms")
    lines.append(f"  targets: async stall <= 1.2x dcp's (median): x{stall_ratio:.2f} "
                 f"{'met' if stall_ratio <= 1.2 else 'NOT MET'}; first async stall <= 1.2x dcp's: "
                 f"x{first[0] / first[1]:.2f} {'met' if first[0] <= 1.2 * first[1] else 'NOT MET'}; sync save <= 1.2x "
                 f"dcp's: x{save_ratio:.2f} {'met' if save_ratio <= 1.2 else 'NOT MET'}; load ({cache} cache) <= 1.1x "
                 f"dcp's: x{load_ratio:.2f} {'met' if load_ratio <= 1.1 else 'NOT MET'}")
    for r in range(2):  # one rank after the other, not interleaved
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="MiB of float32 state in all (half per rank)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--cache", choices=("warm", "cold"), default="warm",
                        help="the shard files' page-cache state before each load (default: warm)")
    parser.add_argument("--no-ahead", action="store_true",
                        help="do not allocate our staging memory ahead (OrtStorageWriter.allocate_staging): the first "
                             "async save allocates it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(args.mb), str(args.rounds), directory,
                                  "0" if args.no_ahead else "1", args.cache],
                                  env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                       "RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
                                       "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])})
                 for rank in range(2)]
        codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1", sys.argv[6])
    else:
        main()
