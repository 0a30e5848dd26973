"""Save/load benchmark: this package's ODTC writer and reader against torch.save, Lightning's default checkpoint IO,
safetensors, ONNX Runtime's own checkpoint code, and raw file I/O of the same number of bytes.

    python benchmarks/save_load.py --params 25 250 --repeat 7 2
    python benchmarks/save_load.py --quick          # a few seconds: a smoke run on a 2M-parameter state
    python benchmarks/save_load.py --params 25 250 --repeat 5 --only ours ours_nosum   # what checksums cost
    python benchmarks/save_load.py --params 25 250 --repeat 7 5 --only ours ours_nosum raw_behind raw_direct
        # every target of issues #13 and #14 (save against its floor, cold load against O_DIRECT, checksum costs)

"ours_nosum" is our writer with ``checksums=False`` and our loader with ``verify=False`` (on the same file as
"ours"): the ratio of the two, measured in one run, is the cost of recording and verifying tensor checksums.

The state is a synthetic transformer-like model of N million float32 parameters (token and position embeddings,
layers of attention q/k/v/o weights and biases, MLP weights and biases, LayerNorms, a final LayerNorm) plus a few
int64 buffers, and AdamW state (exp_avg, exp_avg_sq and step for every trainable parameter), generated in code with a
fixed seed. Every measurement runs in a fresh ``spawn`` subprocess:

* saves: the child builds the state (which writes every page of it), reads VmRSS, resets the peak (``5`` to
  ``/proc/self/clear_refs``), times the save *including fsync of every file written* (our ``save_checkpoint`` also
  renames atomically and fsyncs the directory itself), then reads VmHWM: peak extra = VmHWM - VmRSS before.
* loads: the child evicts every file involved from the page cache (``fsync`` then ``posix_fadvise(DONTNEED)``,
  checked with ``mincore``) for a cold load, or reads them once for a warm load, then times a full load into torch
  tensors followed by the same touch of every loaded tensor for every method (one byte of every 4 KiB page plus the
  last byte, summed), which forces lazily mapped data in. Peak extra memory is reported in total and beyond the bytes
  of the loaded tensors.

Old output files are deleted by the parent *between* measurements, followed by ``sync`` and a wait for the disk to
go idle: on this kind of VM freeing a multi-GB file (ext4 with online discard) costs seconds that must not land in a
timed region. Before every child the parent also drops all benchmark files from the page cache and pauses 2 s, so
each child starts with the same free memory (the guest returns freed memory to its host, and the next first touch of
it is what dominates a multi-GB load here). The baselines are a raw ``write`` + ``fsync`` of as many bytes as our
checkpoint from a touched buffer, and a raw ``readinto`` of that file into a freshly allocated ``np.empty`` buffer
(fresh, as every loader allocates fresh memory). A second write baseline uses our writer's write-behind (each
8 MiB step's writeback started as soon as it is written, the step before waited for and dropped from the page cache,
then fsync): the floor for that technique. A second read baseline reads into memory advised for transparent huge
pages, as our reader allocates it: the raw read minus most of the page faults. A third reads the raw write-behind
file with ``O_DIRECT`` into such memory, in 64 MiB reads: the disk's own pace without the page cache, the floor of
our cold load. The "first touch" row allocates and
touches the same number of bytes without any I/O, the floor under every load here. Methods run interleaved (one of
each per repeat) and the tables show medians and the min-max spread.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import mmap
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any

MB = 1e6
PAGE = mmap.PAGESIZE
SEED = 1234
STEP = 1000
SAVE_METHODS = ["raw", "raw_behind", "ours", "ours_nosum", "torch", "lightning", "safetensors", "ort"]
LOAD_METHODS = ["raw", "raw_huge", "raw_direct", "alloc", "ours", "ours_nosum", "ours_lazy", "torch", "safetensors",
                "ort"]
CHECKSUM_SAVE_MAX, CHECKSUM_LOAD_MAX = 1.05, 1.10  # what recording / verifying tensor checksums may cost
SAVE_FLOOR_MAX = 1.30  # our save against the raw write-behind write of as many bytes from one buffer
COLD_LOAD_MIN_SPEED = 0.80  # our cold full load's speed against a raw O_DIRECT read of as many bytes
PAUSE_S = 2.0  # between children: the guest hands freed memory back to its host after about 2 s
LABELS = {
    "raw": "raw write/read (baseline)",
    "raw_behind": "(raw write with write-behind, 8 MiB steps)",
    "raw_huge": "(raw read into huge-page memory, as our reader allocates)",
    "raw_direct": "(raw O_DIRECT read into huge-page memory, 64 MiB reads)",
    "alloc": "(first touch of fresh memory only, no I/O)",
    "ours": "ours save_/load_checkpoint",
    "ours_nosum": "(ours without checksums: checksums=False / verify=False)",
    "ours_lazy": "ours open_checkpoint (lazy mmap)",
    "torch": "torch.save / torch.load(weights_only)",
    "lightning": "Lightning TorchCheckpointIO",
    "safetensors": "safetensors save_file/load_file",
    "ort": "ORT CheckpointState native",
}
LOAD_FILE = {"alloc": "raw", "raw_huge": "raw", "raw_direct": "raw_behind"}  # baselines read a raw file
FILE_NAMES = {"raw": "raw.bin", "raw_behind": "raw_behind.bin", "ours": "ours.ckpt", "ours_nosum": "nosum.ckpt",
              "torch": "torch.pt",
              "lightning": "lightning.ckpt", "safetensors": "state.safetensors", "ort": "ort.ckpt"}


# ------------------------------------------------------------------------------------------------------------------
# the synthetic state (children only: the parent never imports torch)
# ------------------------------------------------------------------------------------------------------------------
def model_shape(n_million: float) -> dict[str, int]:
    """Width, depth and vocabulary of a transformer with about ``n_million`` million parameters."""
    target = int(n_million * 1e6)
    d = 256 if target < 10e6 else 512 if target < 100e6 else 1024 if target < 1e9 else 2048
    max_pos = 2048 if d >= 1024 else 1024
    per_layer = 12 * d * d + 13 * d  # q,k,v,o (d*d + d each), MLP d->4d->d, two LayerNorms
    layers = max(1, round(0.8 * target / per_layer))
    while layers > 1 and layers * per_layer + (max_pos + 1000) * d > target:
        layers -= 1
    vocab = max(1000, (target - layers * per_layer - max_pos * d - 2 * d) // d)
    return {"d": d, "layers": layers, "vocab": vocab, "max_pos": max_pos}


def build_state(n_million: float) -> dict[str, Any]:
    """Parameters, buffers and AdamW state; every byte written by the generator (so every page is touched)."""
    import torch

    s = model_shape(n_million)
    d, ff = s["d"], 4 * s["d"]
    g = torch.Generator().manual_seed(SEED)

    def randn(*shape: int, scale: float = 0.02) -> Any:
        return torch.empty(shape, dtype=torch.float32).normal_(0.0, scale, generator=g)

    params: dict[str, Any] = {"embeddings.word.weight": randn(s["vocab"], d),
                              "embeddings.position.weight": randn(s["max_pos"], d)}
    for i in range(s["layers"]):
        p = f"encoder.layer.{i}."
        for proj in ("q", "k", "v", "o"):
            params[p + f"attention.{proj}.weight"] = randn(d, d)
            params[p + f"attention.{proj}.bias"] = randn(d)
        params[p + "attention.norm.weight"] = 1.0 + randn(d)
        params[p + "attention.norm.bias"] = randn(d)
        params[p + "mlp.fc1.weight"] = randn(ff, d)
        params[p + "mlp.fc1.bias"] = randn(ff)
        params[p + "mlp.fc2.weight"] = randn(d, ff)
        params[p + "mlp.fc2.bias"] = randn(d)
        params[p + "mlp.norm.weight"] = 1.0 + randn(d)
        params[p + "mlp.norm.bias"] = randn(d)
    params["final_norm.weight"] = 1.0 + randn(d)
    params["final_norm.bias"] = randn(d)
    buffers = {"embeddings.position_ids": torch.arange(s["max_pos"], dtype=torch.int64).reshape(1, -1),
               "embeddings.token_type_ids": torch.zeros(1, s["max_pos"], dtype=torch.int64),
               "num_batches_tracked": torch.tensor(STEP, dtype=torch.int64)}
    exp_avg = {n: randn(*t.shape, scale=1e-3) for n, t in params.items()}
    exp_avg_sq = {n: torch.empty(t.shape, dtype=torch.float32).uniform_(0.0, 1e-6, generator=g)
                  for n, t in params.items()}
    return {"params": params, "buffers": buffers, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "shape": s}


def state_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for k in ("params", "buffers", "exp_avg", "exp_avg_sq")
               for t in state[k].values())


def as_ours(state: dict[str, Any]) -> Any:
    from lightning_ort_ckpt.format import CheckpointContents, OptimizerGroup

    states = {n: {"momentum0": state["exp_avg"][n], "momentum1": state["exp_avg_sq"][n]} for n in state["params"]}
    return CheckpointContents(trainable=dict(state["params"]), frozen=dict(state["buffers"]),
                      optimizer_groups={"group0": OptimizerGroup(STEP, 1e-3, states)},
                      properties={"epoch": 3, "global_step": STEP})


def as_lightning(state: dict[str, Any]) -> dict[str, Any]:
    """What Lightning's ``dump_checkpoint`` produces for a module with one AdamW optimizer (minus loops/callbacks)."""
    import torch

    names = list(state["params"])
    return {
        "epoch": 3, "global_step": STEP, "pytorch-lightning_version": "2.6.6",
        "state_dict": {**state["params"], **state["buffers"]},
        "optimizer_states": [{
            "state": {i: {"step": torch.tensor(float(STEP)), "exp_avg": state["exp_avg"][n],
                          "exp_avg_sq": state["exp_avg_sq"][n]} for i, n in enumerate(names)},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                              "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                              "differentiable": False, "fused": None, "params": list(range(len(names)))}],
        }],
        "lr_schedulers": [],
    }


def as_flat(state: dict[str, Any]) -> dict[str, Any]:
    """The Lightning dict flattened into one dict of tensors, as safetensors needs."""
    import torch

    flat = {f"state_dict.{n}": t for n, t in {**state["params"], **state["buffers"]}.items()}
    for i, n in enumerate(state["params"]):
        flat[f"optimizer.state.{i}.exp_avg"] = state["exp_avg"][n]
        flat[f"optimizer.state.{i}.exp_avg_sq"] = state["exp_avg_sq"][n]
        flat[f"optimizer.state.{i}.step"] = torch.tensor(float(STEP))
    return flat


def tensors_in(obj: Any) -> list[Any]:
    """Every torch tensor in a nested structure (dicts, lists, tuples, our CheckpointContents)."""
    import torch

    from lightning_ort_ckpt.format import CheckpointContents

    out: list[Any] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, CheckpointContents):
            stack += [o.trainable, o.frozen]
            stack += [g.states for g in o.optimizer_groups.values()]
    return out


def touch(tensors: list[Any]) -> int:
    """Read one byte of every page of every tensor (and its last byte): the same work for every method."""
    import torch

    total = 0
    for t in tensors:
        if t.numel() == 0:
            continue
        b = t.reshape(-1).view(torch.uint8)
        total += int(b[::PAGE].sum()) + int(b[-1])
    return total


# ------------------------------------------------------------------------------------------------------------------
# process-level helpers
# ------------------------------------------------------------------------------------------------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_of(method: str, path: str) -> list[str]:
    return [p for p in (path, path + ".data") if os.path.exists(p)]


def resident_fraction(path: str) -> float:
    """Fraction of the file's pages in the page cache (mincore on a fresh, untouched shared mapping)."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    pages = (size + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    try:
        if libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
    finally:
        libc.munmap(addr, size)
    return (pages - bytes(vec).count(0)) / pages


def evict(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED skips dirty pages
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[str]) -> None:
    buf = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# ------------------------------------------------------------------------------------------------------------------
# children
# ------------------------------------------------------------------------------------------------------------------
def raw_write_behind(path: str, data: memoryview) -> None:
    """A raw write in steps through our writer's ``WriteBehind`` (each step's writeback started as soon as it is
    written, the step before waited for and dropped from the page cache), then fsync: the floor for that technique
    when the bytes come from one buffer."""
    from lightning_ort_ckpt.format._diskio import BEHIND_BYTES, WriteBehind

    with open(path, "xb", buffering=0) as f:
        behind = WriteBehind.open(f)
        if behind is None:
            raise OSError(f"write-behind is not available for {path}")
        pos = 0
        while pos < len(data):
            pos += f.write(data[pos:pos + BEHIND_BYTES])
            behind.advance(pos)
        os.fsync(f.fileno())


def preimport(method: str) -> None:
    """Import the library ``method`` measures before its timer starts (imported lazily, so that a run with
    ``--only`` needs only what it measures)."""
    import importlib

    name = {"ort": "onnxruntime.training.api", "lightning": "pytorch_lightning.plugins.io",
            "safetensors": "safetensors.torch"}.get(method)
    if name is not None:
        importlib.import_module(name)


def raw_direct_read(path: str) -> Any:
    """The whole file read with ``O_DIRECT`` (no page cache) in 64 MiB reads, into memory advised for huge pages
    (as our reader allocates it)."""
    from lightning_ort_ckpt.format._diskio import fresh_memory

    size = os.path.getsize(path)
    blocks = -(-size // 4096) * 4096
    buf = fresh_memory(max(blocks, 2 << 20))  # an mmap: page-aligned, as O_DIRECT needs
    view, pos = memoryview(buf), 0
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        while pos < size:
            n = os.preadv(fd, [view[pos:min(pos + (64 << 20), blocks)]], pos)
            if not n:
                raise EOFError(path)
            pos += n
    finally:
        os.close(fd)
    return buf[:size]


def child_save(method: str, n_million: float, path: str, raw_size: int, ours_path: str) -> dict[str, Any]:
    import torch

    from lightning_ort_ckpt.format import save_checkpoint
    from lightning_ort_ckpt.format import _atomic as atomic


    res: dict[str, Any] = {}
    if method in ("raw", "raw_behind"):
        if raw_size <= 0:
            return {"error": "no size to write (our save failed)", "seconds": float("nan"), "peak_extra": float("nan")}
        g = torch.Generator().manual_seed(SEED)
        buf = torch.empty(raw_size // 4 + 1, dtype=torch.float32).normal_(generator=g)
        data = memoryview(buf.view(torch.uint8).numpy())[:raw_size]
    elif method == "ort":
        from onnxruntime.training.api import CheckpointState

        ort_state = CheckpointState.load_checkpoint(ours_path)  # ORT copies every byte into its own OrtValues
    else:
        state = build_state(n_million)
        res["state_bytes"] = state_bytes(state)
        obj = {"ours": as_ours, "ours_nosum": as_ours, "torch": as_lightning, "lightning": as_lightning,
               "safetensors": as_flat}[method](state)

    mode = "auto"
    preimport(method)
    rss0 = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    try:
        if method == "raw_behind":
            raw_write_behind(path, data)
        elif method == "raw":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = data
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        elif method in ("ours", "ours_nosum"):  # fsyncs the file(s), renames, fsyncs the directory
            save_checkpoint(obj, path, external_data=mode, checksums=method == "ours")
        elif method == "torch":
            torch.save(obj, path)
            _fsync_path(path)
        elif method == "lightning":
            from pytorch_lightning.plugins.io import TorchCheckpointIO

            TorchCheckpointIO().save_checkpoint(obj, path)
            _fsync_path(path)
        elif method == "safetensors":
            from safetensors.torch import save_file

            save_file(obj, path)
            _fsync_path(path)
        elif method == "ort":
            from onnxruntime.training.api import CheckpointState

            CheckpointState.save_checkpoint(ort_state, path, include_optimizer_state=True)
            for p in files_of(method, path):
                _fsync_path(p)
    except Exception as e:  # recorded, not fatal: e.g. ORT past its limits
        res["error"] = f"{type(e).__name__}: {e}".strip()[:400]
    res["seconds"] = time.perf_counter() - t0
    res["peak_extra"] = _status("VmHWM") - rss0
    if method in ("ours", "ours_nosum"):
        atomic.wait_for_cleanup()
    res["files"] = {os.path.basename(p): os.path.getsize(p) for p in files_of(method, path)}
    return res


def child_load(method: str, path: str, cold: bool) -> dict[str, Any]:
    import numpy as np
    import torch


    from lightning_ort_ckpt.format import load_checkpoint, open_checkpoint
    from lightning_ort_ckpt.format._diskio import fresh_memory

    paths = files_of(method, path)
    if not paths or not os.path.getsize(paths[0]):
        return {"error": "nothing to load: the save failed", "seconds": float("nan"), "peak_extra": float("nan")}
    if cold:
        evict(paths)
    else:
        warm(paths)
    resident = sum(resident_fraction(p) * os.path.getsize(p) for p in paths) / sum(os.path.getsize(p) for p in paths)
    res: dict[str, Any] = {"resident_before": resident}
    keep: Any = None
    preimport(method)
    rss0 = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    try:
        if method == "alloc":  # what every loader pays before any byte is copied: fresh pages, first touch
            buf = np.empty(os.path.getsize(path), dtype=np.uint8)
            buf[::PAGE] = 1
            keep = [torch.from_numpy(buf)]
        elif method == "raw_direct":  # the disk's own pace, with no page cache: the floor of our cold load
            keep = [torch.from_numpy(raw_direct_read(path))]
        elif method in ("raw", "raw_huge"):
            size = os.path.getsize(path)
            buf = np.empty(size, dtype=np.uint8) if method == "raw" else fresh_memory(size)
            with open(path, "rb", buffering=0) as f:
                view, pos = memoryview(buf), 0
                while pos < size:
                    n = f.readinto(view[pos:])
                    if not n:
                        raise EOFError(path)
                    pos += n
            keep = [torch.from_numpy(buf)]
        elif method in ("ours", "ours_nosum"):  # the same file; with and without verifying every tensor
            keep = tensors_in(load_checkpoint(path, verify=method == "ours"))
        elif method == "ours_lazy":  # zero-copy views of the mapping; they stay valid after the reader closes
            with open_checkpoint(path) as reader:
                keep = [reader.torch(i) for i in reader.tensors() if i.storage in ("inline", "external")]
        elif method == "torch":
            keep = tensors_in(torch.load(path, weights_only=True))
        elif method == "safetensors":
            from safetensors.torch import load_file

            keep = tensors_in(load_file(path))
        elif method == "ort":
            from onnxruntime.training.api import CheckpointState

            keep = CheckpointState.load_checkpoint(path)  # into OrtValues; not reachable as torch tensors
        if method != "ort":
            res["checksum"] = touch(keep)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}".strip()[:400]
    res["seconds"] = time.perf_counter() - t0
    res["peak_extra"] = _status("VmHWM") - rss0
    if method != "ort" and keep is not None and "error" not in res:
        res["loaded_bytes"] = sum(t.numel() * t.element_size() for t in keep)
    del keep
    return res


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def run_child(fn: Any, *args: Any) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    load = loadavg()  # the machine is shared: record how busy it was
    try:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
            res = ex.submit(fn, *args).result()
    except Exception as e:  # the child died (killed for memory, a crash in native code)
        res = {"error": f"child process failed: {type(e).__name__}: {e}"[:400], "seconds": float("nan"),
               "peak_extra": float("nan")}
    res["loadavg"] = max(load, loadavg())
    return res


# ------------------------------------------------------------------------------------------------------------------
# parent
# ------------------------------------------------------------------------------------------------------------------
def _block_stat(directory: str) -> str | None:
    dev = os.stat(directory).st_dev
    p = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    return p if os.path.exists(p) else None


def settle(directory: str, timeout: float = 60.0) -> None:
    """sync, then wait until the disk has been idle for half a second (deferred discards and writeback done)."""
    os.sync()
    stat = _block_stat(directory)
    if stat is None:
        time.sleep(1.0)
        return
    deadline = time.monotonic() + timeout
    prev = None
    while time.monotonic() < deadline:
        with open(stat) as f:
            fields = f.read().split()
        ios = (fields[0], fields[4], fields[11] if len(fields) > 11 else "")  # reads, writes, discards completed
        if prev == ios and fields[8] == "0":
            return
        prev = ios
        time.sleep(0.5)


def evict_all(directory: str) -> None:
    """Drop every benchmark file from the page cache, so that each child starts with the same free memory."""
    os.sync()
    for entry in os.scandir(directory):
        if entry.is_file():
            evict([entry.path])


def remove(paths: list[str], directory: str) -> None:
    removed = False
    for p in paths:
        for q in (p, p + ".data"):
            if os.path.lexists(q):
                os.unlink(q)
                removed = True
    settle(directory) if removed else os.sync()


def machine() -> dict[str, str]:
    info = {"nproc": str(os.cpu_count()), "python": platform.python_version(), "kernel": platform.release()}
    with open("/proc/meminfo") as f:
        info["MemTotal"] = f.readline().split(":")[1].strip()
    with open("/proc/cpuinfo") as f:
        info["cpu"] = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    return info


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [r["error"] for r in rows if "error" in r]
    ok = [r for r in rows if "error" not in r]
    out: dict[str, Any] = {"n": len(rows), "errors": errors}
    if ok:
        out["seconds"] = _median([r["seconds"] for r in ok])
        out["all_seconds"] = [round(r["seconds"], 3) for r in ok]
        out["peak_extra"] = max(r["peak_extra"] for r in ok)
        if "loaded_bytes" in ok[0]:
            out["loaded_bytes"] = ok[0]["loaded_bytes"]
        if "files" in ok[-1]:
            out["files"] = ok[-1]["files"]
        if "external_data" in ok[-1]:
            out["mode"] = ok[-1]["external_data"]
        if "resident_before" in ok[0]:
            out["resident_before"] = max(r["resident_before"] for r in ok)
    return out


def fmt_s(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.3f}"


def fmt_x(x: float | None, base: float | None) -> str:
    return "-" if not x or not base or x != x or base != base else f"{x / base:.2f}x"


def spread(summary: dict[str, Any]) -> str:
    xs = summary.get("all_seconds") or []
    return f"{min(xs):.2f}-{max(xs):.2f}" if len(xs) > 1 else "-"


def fmt_mb(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x / MB:,.1f}"


def bench_size(n_million: float, repeat: int, root: str, log: Any, only: set[str] | None = None) -> dict[str, Any]:
    directory = os.path.join(root, f"{n_million:g}M")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    settle(directory)
    paths = {m: os.path.join(directory, FILE_NAMES[m]) for m in SAVE_METHODS}
    saves: dict[str, list[dict[str, Any]]] = {m: [] for m in SAVE_METHODS}
    raw_size = 0
    state_b = 0
    for r in range(repeat):
        # ours first: the raw baselines write as many bytes as our checkpoint has
        order = ["ours", "ours_nosum", "raw", "raw_behind", "torch", "lightning", "safetensors", "ort"]
        for m in order:
            if only is not None and m not in only:
                continue
            remove([paths[m]], directory)
            evict_all(directory)
            time.sleep(PAUSE_S)
            res = run_child(child_save, m, n_million, paths[m], raw_size, paths["ours"])
            saves[m].append(res)
            if m == "ours" and "files" in res and "error" not in res:
                raw_size = raw_size or sum(res["files"].values())
            if res.get("state_bytes"):
                state_b = res["state_bytes"]
                raw_size = raw_size or (state_b if m == "ours" else 0)  # our save failed: the state's bytes
            log(f"  save {m:12s} rep {r + 1}/{repeat}: {fmt_s(res.get('seconds'))} s, peak extra "
                f"{fmt_mb(res.get('peak_extra'))} MB, loadavg {res['loadavg']:.1f}"
                f"{'  ERROR ' + res['error'] if 'error' in res else ''}")
    os.sync()
    load_paths = dict(paths)
    load_paths["ours_lazy"] = load_paths["ours_nosum"] = paths["ours"]
    ort_note = ""
    if not os.path.exists(paths["ort"]) and (only is None or "ort" in only):
        load_paths["ort"] = paths["ours"]
        ort_note = "ORT save failed, so ORT loads the file our writer wrote (same format)"
    loads: dict[tuple[str, str], list[dict[str, Any]]] = {(m, c): [] for m in LOAD_METHODS for c in ("cold", "warm")}
    for r in range(repeat):
        for m in LOAD_METHODS:
            if only is not None and m not in only:
                continue
            for c in ("cold", "warm"):
                evict_all(directory)  # the child then evicts (cold) or reads (warm) its own files
                time.sleep(PAUSE_S)
                res = run_child(child_load, m, load_paths[LOAD_FILE.get(m, m)], c == "cold")
                loads[(m, c)].append(res)
                log(f"  load {m:12s} {c} rep {r + 1}/{repeat}: {fmt_s(res.get('seconds'))} s, peak extra "
                    f"{fmt_mb(res.get('peak_extra'))} MB, resident before {res.get('resident_before', 0):.3f}, "
                    f"loadavg {res['loadavg']:.1f}"
                    f"{'  ERROR ' + res['error'] if 'error' in res else ''}")
    loads_seen = [r["loadavg"] for rows in [*saves.values(), *loads.values()] for r in rows]
    return {"params_million": n_million, "shape": None, "repeat": repeat, "state_bytes": state_b,
            "loadavg": {"median": _median(loads_seen), "max": max(loads_seen)},
            "raw_size": raw_size, "ort_note": ort_note,
            "save": {m: summarize(v) for m, v in saves.items() if v},
            "load": {f"{m}/{c}": summarize(v) for (m, c), v in loads.items() if v}}


def report(res: dict[str, Any]) -> str:
    lines = []
    sb = res["state_bytes"]
    lines.append(f"### {res['params_million']:g}M parameters + AdamW: state {sb / MB:,.1f} MB, "
                 f"{res['repeat']} repeat(s), medians")
    lines.append("")
    raw = res["save"].get("raw", {}).get("seconds")
    lines.append("| save (fsync included) | seconds | x raw write | min-max s | file size MB | peak extra MB |")
    lines.append("|---|---:|---:|---:|---:|---:|")
    for m in SAVE_METHODS:
        if m not in res["save"]:
            continue
        s = res["save"][m]
        if "seconds" not in s:
            lines.append(f"| {LABELS[m]} | fails: {'; '.join(sorted(set(s['errors'])))} | | | | |")
            continue
        files = s.get("files", {})
        size = " + ".join(f"{v / MB:,.1f}" for v in files.values()) if files else "-"
        label = LABELS[m] + (f" (external_data={s['mode']!r})" if s.get("mode", "auto") != "auto" else "")
        lines.append(f"| {label} | {fmt_s(s['seconds'])} | {fmt_x(s['seconds'], raw)} | {spread(s)} | {size} | "
                     f"{fmt_mb(s['peak_extra'])} |")
    lines.append("")
    rc = res["load"].get("raw/cold", {}).get("seconds")
    rw = res["load"].get("raw/warm", {}).get("seconds")
    lines.append("| load + touch | cold s | x raw read | cold min-max | warm s | x raw read | warm min-max "
                 "| peak extra MB (total) | beyond loaded tensors MB |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in LOAD_METHODS:
        if f"{m}/cold" not in res["load"]:
            continue
        c, w = res["load"][f"{m}/cold"], res["load"][f"{m}/warm"]
        if "seconds" not in c or "seconds" not in w:
            errs = sorted(set(c["errors"] + w["errors"]))
            lines.append(f"| {LABELS[m]} | fails: {'; '.join(errs)} | | | | | | | |")
            continue
        peak = max(c["peak_extra"], w["peak_extra"])
        loaded = c.get("loaded_bytes", sb)
        lines.append(f"| {LABELS[m]} | {fmt_s(c['seconds'])} | {fmt_x(c['seconds'], rc)} | {spread(c)} | "
                     f"{fmt_s(w['seconds'])} | {fmt_x(w['seconds'], rw)} | {spread(w)} | {fmt_mb(peak)} | "
                     f"{fmt_mb(peak - loaded)} |")
    lines.append("")
    lines.append("raw timings (s): " + "; ".join(
        f"save {m} {res['save'][m].get('all_seconds')}" for m in SAVE_METHODS if m in res["save"]) + "; " + "; ".join(
        f"load {k} {v.get('all_seconds')}" for k, v in res["load"].items()))
    lines.append("")
    lines.append(f"1-minute load average during the measurements (2 CPUs, shared machine): median "
                 f"{res['loadavg']['median']:.1f}, max {res['loadavg']['max']:.1f}")
    lines.append("")
    lines.append("page-cache residency before cold loads (max over repeats): " + ", ".join(
        f"{m} {res['load'][f'{m}/cold'].get('resident_before', float('nan')):.3f}" for m in LOAD_METHODS
        if f"{m}/cold" in res["load"]))
    if res["ort_note"]:
        lines.append("")
        lines.append("note: " + res["ort_note"])
    lines.append("")
    lines.append(targets(res))
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "met" if ok else "not met"


def targets(res: dict[str, Any]) -> str:
    """Each target of issues #13 and #14 with the ratio measured in this run, what it was measured against, and
    met / not met."""
    lines = ["targets (each a ratio of medians measured in this run):"]
    o = res["save"].get("ours", {})
    rb = res["save"].get("raw_behind", {}).get("seconds")
    if "seconds" in o and rb and rb == rb:
        x = o["seconds"] / rb
        lines.append(f"- save / raw write-behind write of as many bytes from one buffer (the floor, fsync included) "
                     f"<= {SAVE_FLOOR_MAX:.2f}x: {o['seconds']:.3f} s / {rb:.3f} s = {x:.2f}x -> "
                     f"{verdict(x <= SAVE_FLOOR_MAX)}")
    lc, dc = res["load"].get("ours/cold", {}), res["load"].get("raw_direct/cold", {})
    if "seconds" in lc and "seconds" in dc:
        speed = dc["seconds"] / lc["seconds"]
        lines.append(f"- cold full load (verified, + touch) speed / raw O_DIRECT read of as many bytes (+ touch) >= "
                     f"{COLD_LOAD_MIN_SPEED:.2f}x: {dc['seconds']:.3f} s / {lc['seconds']:.3f} s = {speed:.2f}x -> "
                     f"{verdict(speed >= COLD_LOAD_MIN_SPEED)}")
    lines += ["- " + line for line in checksum_cost(res)]
    if "seconds" in o:
        ckpt = sum(o.get("files", {}).values())
        limit = max(64 * 2**20, 0.05 * ckpt)
        lines.append(f"- save peak extra memory (VmHWM - VmRSS before) <= max(64 MiB, 5% of the checkpoint) = "
                     f"{limit / MB:,.1f} MB: {o['peak_extra'] / MB:,.1f} MB -> {verdict(o['peak_extra'] <= limit)}")
    raw = res["save"].get("raw", {}).get("seconds")
    if "seconds" in o and raw and raw == raw:
        lines.append(f"- (earlier target) save <= 1.10x raw write + fsync: {o['seconds'] / raw:.2f}x -> "
                     f"{verdict(o['seconds'] / raw <= 1.10)}")
    for c in ("cold", "warm"):
        lo, base = res["load"].get(f"ours/{c}", {}), res["load"].get(f"raw/{c}", {}).get("seconds")
        if "seconds" in lo and base and base == base:
            x = lo["seconds"] / base
            lines.append(f"- (earlier target) full load {c} <= 1.30x raw buffered read: {x:.2f}x -> "
                         f"{verdict(x <= 1.30)}")
    return "\n".join(lines)


def checksum_cost(res: dict[str, Any]) -> list[str]:
    """Save and load with tensor checksums against the same without, measured in this run (medians)."""
    rows = []
    pairs = [("save", res["save"].get("ours", {}), res["save"].get("ours_nosum", {}), CHECKSUM_SAVE_MAX)]
    pairs += [(f"load {c}", res["load"].get(f"ours/{c}", {}), res["load"].get(f"ours_nosum/{c}", {}),
               CHECKSUM_LOAD_MAX) for c in ("cold", "warm")]
    for what, with_, without, limit in pairs:
        if "seconds" not in with_ or "seconds" not in without:
            continue
        x = with_["seconds"] / without["seconds"]
        rows.append(f"checksum cost, {what} with / without checksums <= {limit:.2f}x: {with_['seconds']:.3f} s / "
                    f"{without['seconds']:.3f} s = {x:.3f}x -> {verdict(x <= limit)}")
    return rows or ["checksum cost: not measured (run ours and ours_nosum)"]


def main(argv: list[str] | None = None) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, nargs="+", default=[25.0, 250.0], help="sizes, millions of params")
    ap.add_argument("--repeat", type=int, nargs="+", default=[3],
                    help="repeats: one number for every size, or one per --params entry")
    ap.add_argument("--dir", default=os.path.join(here, "out", "save_load"), help="scratch directory")
    ap.add_argument("--quick", action="store_true", help="a tiny smoke run (2M params, 1 repeat)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint files afterwards")
    ap.add_argument("--only", nargs="+", choices=sorted(set(SAVE_METHODS) | set(LOAD_METHODS)),
                    help="measure only these methods (e.g. --only ours ours_nosum raw: the checksum cost)")
    args = ap.parse_args(argv)
    if args.quick:
        args.params, args.repeat = [2.0], [1]
    if len(args.repeat) not in (1, len(args.params)):
        ap.error("--repeat takes one number or one per --params entry")
    repeats = args.repeat * len(args.params) if len(args.repeat) == 1 else args.repeat
    root = os.path.abspath(args.dir)
    os.makedirs(root, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    cmd = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    log(f"command: {cmd}")
    info = machine()
    df = subprocess.run(["df", "-T", root], capture_output=True, text=True).stdout.strip()
    log("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    log("df -T:\n" + df)
    versions = subprocess.run([sys.executable, "-c", "import torch, safetensors, onnxruntime, pytorch_lightning, "
                               "numpy; print(f'torch {torch.__version__}, safetensors {safetensors.__version__}, "
                               "onnxruntime-training {onnxruntime.__version__}, pytorch-lightning "
                               "{pytorch_lightning.__version__}, numpy {numpy.__version__}')"],
                              capture_output=True, text=True).stdout.strip()
    log("versions: " + versions)
    repo = os.path.dirname(here)
    git = subprocess.run(["git", "-C", repo, "log", "-1", "--format=%h %s"], capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "-C", repo, "status", "--short", "--", "lightning_ort_ckpt"], capture_output=True,
                           text=True).stdout.split("\n")
    git = git.strip()[:100] + (f" + uncommitted: {', '.join(d.split()[-1] for d in dirty if d.strip())}"
                              if any(d.strip() for d in dirty) else "")
    log("code: " + git)
    results = []
    t_start = time.monotonic()
    for n, rep in zip(args.params, repeats):
        log(f"\n== {n:g}M parameters, {rep} repeat(s); model shape {model_shape(n)} ==")
        res = bench_size(n, rep, root, log, set(args.only) if args.only else None)
        res["shape"] = model_shape(n)
        results.append(res)
        log("")
        log(report(res))
        if not args.keep:
            shutil.rmtree(os.path.join(root, f"{n:g}M"), ignore_errors=True)
            settle(root)
    log("\n== targets, all sizes ==")
    for res in results:
        log(f"\n{res['params_million']:g}M parameters, {res['repeat']} repeat(s):\n{targets(res)}")
    log(f"\ntotal wall time {time.monotonic() - t_start:,.0f} s")
    with open(os.path.join(root, "results.json"), "w") as f:
        json.dump({"command": cmd, "machine": info, "df": df, "versions": versions, "code": git, "results": results}, f,
                  indent=1, default=str)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.exit(130)
