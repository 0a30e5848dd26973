"""Where a save's time goes: the same bytes written with write-behind in different patterns, in one process,
interleaved (one of each per repeat), so that a noisy machine slows them alike.

    python benchmarks/write_patterns.py --params 25 --repeat 7
    python benchmarks/write_patterns.py --params 250 --repeat 3

Patterns, all ending with fsync: ``one_buffer``, the bytes of the whole state from one buffer in 8 MiB writes (the
floor that ``save_load.py`` calls "raw write with write-behind"); ``per_tensor``, each tensor written by itself
(what our writer did before issue #13: writes that end anywhere); ``step_aligned``, the tensors gathered by
reference into one ``writev`` per 8 MiB step of the file (our writer's streaming alone); and our ``save_checkpoint``
with and without checksums (which also plans, interleaves the metadata, renames atomically and fsyncs the
directory). The state is ``save_load.py``'s synthetic transformer with AdamW state. The process CPU time of each
is printed too: it is much less sensitive to other jobs than the wall time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import save_load as sl  # noqa: E402  (the state and the write-behind floor are shared with the main benchmark)


def per_tensor(path: str, views: list[memoryview]) -> None:
    from lightning_ort_ckpt.format._diskio import BEHIND_BYTES, WriteBehind

    with open(path, "xb", buffering=0) as f:
        behind, pos = WriteBehind.open(f), 0
        for view in views:
            while view:
                n = f.write(view[:BEHIND_BYTES])
                view, pos = view[n:], pos + n
                if behind is not None:
                    behind.advance(pos)
        os.fsync(f.fileno())


def step_aligned(path: str, views: list[memoryview]) -> None:
    """The tensors' bytes through our writer's streaming machinery alone (no planning, metadata or checksums)."""
    from lightning_ort_ckpt.format._writer import _Hashing, _Tensors, _Writer

    with open(path, "xb", buffering=0) as f:
        writer = _Writer(f, _Hashing(_Tensors(path), enabled=False))
        for view in views:
            writer.small(view)
        writer.close()
        os.fsync(f.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=25.0, help="millions of parameters")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "patterns"))
    args = ap.parse_args()
    import torch

    from lightning_ort_ckpt.format import save_checkpoint

    os.makedirs(args.dir, exist_ok=True)
    state = sl.build_state(args.params)
    ck = sl.as_ours(state)
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in sl.tensors_in(ck) if t.numel()]
    total = sum(len(v) for v in views)
    one = torch.empty(total // 4 + 1).normal_()  # touched, like the tensors
    one_view = memoryview(one.view(torch.uint8).numpy())[:total]
    patterns: dict[str, Any] = {
        "one_buffer": lambda p: sl.raw_write_behind(p, one_view),
        "per_tensor": lambda p: per_tensor(p, views),
        "step_aligned": lambda p: step_aligned(p, views),
        "ours": lambda p: save_checkpoint(ck, p, checksums=True),
        "ours_nosum": lambda p: save_checkpoint(ck, p, checksums=False),
    }
    wall: dict[str, list[float]] = {k: [] for k in patterns}
    cpu: dict[str, list[float]] = {k: [] for k in patterns}
    print(f"{args.params:g}M parameters: {len(views)} tensors, {total / 1e6:,.1f} MB; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    for _ in range(args.repeat):
        for name, fn in patterns.items():
            path = os.path.join(args.dir, name + ".bin")
            for p in (path, path + ".data"):
                if os.path.exists(p):
                    os.unlink(p)
            sl.settle(args.dir)
            time.sleep(1.0)
            c0, t0 = time.process_time(), time.perf_counter()
            fn(path)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    floor = statistics.median(wall["one_buffer"])
    print("| pattern (fsync included) | median s | x one buffer | min-max s | CPU s (median) |")
    print("|---|---:|---:|---:|---:|")
    for name in patterns:
        m = statistics.median(wall[name])
        print(f"| {name} | {m:.3f} | {m / floor:.2f}x | {min(wall[name]):.3f}-{max(wall[name]):.3f} | "
              f"{statistics.median(cpu[name]):.3f} |")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
