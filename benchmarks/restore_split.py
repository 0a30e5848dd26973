"""Where a restore's read of an ORT file goes (issue 39, point 6): the parts of ``load_checkpoint`` against a raw
read of the same bytes, each in a fresh process (fresh memory, as after a preemption), with the page cache cold or
warm.

    python benchmarks/restore_split.py                  # 25M parameters + AdamW, cold, 7 rounds
    python benchmarks/restore_split.py --cache warm

Measured per round, in this order, each in a process of its own, the file put in the same cache state before each:
``raw`` (``readinto`` of the whole file into fresh memory, as ``benchmarks/restore.py``'s baseline), ``open``
(opening the checkpoint and parsing its index: every offset checked), ``load, no checksums``
(``load_checkpoint(verify=False)``: open, index, every tensor read into memory of its own) and ``load``
(``load_checkpoint()``: the same, every tensor checked against its checksum). ``hash`` is the checksums alone,
over the tensors' bytes already in memory. Medians of ``--rounds``; the file is the one ``benchmarks/restore.py``
saves (a stack of ``Linear`` layers, 1 MiB a weight, and its AdamW moments).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import restore  # noqa: E402  (the same checkpoint, cache states and raw read as benchmarks/restore.py)

_PARTS = ("raw", "open", "load, no checksums", "load")


def _child(part: str, path: str) -> None:
    from lightning_ort_ckpt.format import load_checkpoint, open_checkpoint

    start = time.perf_counter()
    if part == "raw":
        restore._raw_read([path])
    elif part == "open":
        open_checkpoint(path).close()
    else:
        load_checkpoint(path, verify=part == "load")
    seconds = time.perf_counter() - start
    extra = {}
    if part == "load":  # the checksums alone, over bytes already in memory (the file is cached now: read it so)
        from lightning_ort_ckpt.format import _checksums

        with open_checkpoint(path) as reader:
            infos = [(i, reader.read_bytes(i)) for i in reader.tensors() if i.storage in ("inline", "external")]
        hash_start = time.perf_counter()
        for info, data in infos:
            h = _checksums.hasher(int(info.dtype), info.shape)
            h.update(data)
            h.intdigest()
        extra["hash"] = time.perf_counter() - hash_start
    print(json.dumps({part: seconds, **extra}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25, help="million parameters (default 25)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cache", choices=("warm", "cold"), default="cold")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="restore-split-") as tmp:
        files = restore._write(Path(tmp), args.params)["ours"]
        path = next(f for f in files if f.endswith(".ckpt"))
        load_before = os.getloadavg()[0]
        for _ in range(args.rounds):
            for part in _PARTS:
                restore._prepare(files, args.cache == "warm")
                out = subprocess.run([sys.executable, __file__, "--child", part, path], check=True, env=env,
                                     capture_output=True, text=True).stdout
                for k, v in json.loads(out.strip().splitlines()[-1]).items():
                    times.setdefault(k, []).append(v)
        size = sum(os.path.getsize(f) for f in files)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"{size / 1e6:.1f} MB, page cache {args.cache}, {args.rounds} rounds, load average {load_before:.1f} at the "
          f"start and {os.getloadavg()[0]:.1f} at the end; medians (min-max), ratio to the raw read:")
    for k, v in times.items():
        print(f"  {k:20s} {median[k]:.3f} s ({min(v):.3f}-{max(v):.3f})  {median[k] / median['raw']:.2f}x")


if __name__ == "__main__":
    main()
