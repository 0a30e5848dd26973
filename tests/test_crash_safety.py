"""Never lose data: a save that is killed, fails, or finds too little disk leaves the previous checkpoint intact.

Kills are real: a child Python process saves, and is SIGKILLed by the parent (or by itself at a chosen point of the
commit). Nothing in the format layer is mocked except ``shutil.disk_usage`` for the free-space pre-check.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from ort_reference import assert_same_checkpoint

from lightning_ort_ckpt import CheckpointError, CheckpointSaveError
from lightning_ort_ckpt.format import Checkpoint, OptimizerGroup, load_checkpoint, open_checkpoint, save_checkpoint
from lightning_ort_ckpt.format import atomic

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
MODES = ["never", "params"]  # inline, and parameters in <path>.data
BIG_SIDE = 8192  # the big checkpoint: one 8192 x 8192 float32 tensor = 256 MiB


# -- checkpoints (also imported by the child processes) ---------------------------------------------------------
def small_checkpoint(seed: int) -> Checkpoint:
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(4, 3, generator=g), torch.randn(3, generator=g)
    return Checkpoint(
        trainable={"fc.weight": w, "fc.bias": b, "temperature": torch.tensor(float(seed))},
        frozen={"bn.num_batches_tracked": torch.tensor(seed * 1000, dtype=torch.int64),
                "bn.running_mean": torch.randn(3, generator=g)},
        optimizer_groups={"group0": OptimizerGroup(
            step=seed, initial_learning_rate=0.01,
            states={n: {"momentum0": torch.randn(t.shape, generator=g), "momentum1": torch.rand(t.shape, generator=g)}
                    for n, t in (("fc.weight", w), ("fc.bias", b))})},
        properties={"seed": seed, "loss": 1.0 / (seed + 1), "tag": f"checkpoint-{seed}"})


def big_checkpoint(seed: int) -> Checkpoint:
    """256 MiB in one non-contiguous tensor (so it is copied out in chunks: the save takes a while)."""
    ck = small_checkpoint(seed)
    ck.trainable["big"] = torch.full((BIG_SIDE, BIG_SIDE), float(seed)).t()
    return ck


def data_file(path: Path) -> Path:
    return Path(atomic.data_path(str(path)))




def expected(seed: int) -> Checkpoint:
    """What a saved small_checkpoint(seed) loads as (float properties come back as float32)."""
    ck = small_checkpoint(seed)
    ck.properties["loss"] = float(torch.tensor(ck.properties["loss"], dtype=torch.float32))
    for group in ck.optimizer_groups.values():
        group.initial_learning_rate = float(torch.tensor(group.initial_learning_rate, dtype=torch.float32))
    return ck


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def leftovers(directory: Path, pid: int | None = None) -> list[str]:
    """Temporary, journal and retired files in ``directory`` (of process ``pid`` if given)."""
    names = [n for n in os.listdir(directory) if n.endswith((".tmp", ".old", atomic.JOURNAL_SUFFIX))]
    return sorted(n for n in names if pid is None or f".{pid}." in n)


# -- child processes --------------------------------------------------------------------------------------------
_PRELUDE = f"""
import json, os, resource, shutil, signal, sys
sys.path.insert(0, {TESTS_DIR!r})
from test_crash_safety import big_checkpoint, small_checkpoint
from lightning_ort_ckpt.format import save_checkpoint
from lightning_ort_ckpt.format import atomic
path, mode = sys.argv[1], sys.argv[2]
extra = sys.argv[3:]

def save_a_and_keep_a_copy():
    save_checkpoint(small_checkpoint(1), path, external_data=mode)
    shutil.copyfile(path, path + ".ref")
    if os.path.exists(atomic.data_path(path)):
        shutil.copyfile(atomic.data_path(path), path + ".ref.data")
"""


def child(body: str, path: Path, mode: str, *extra: str) -> subprocess.Popen:
    code = _PRELUDE + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code, str(path), mode, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(path.parent))


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"child process hung:\n{out}\n{err}")
    return out, err


def assert_is_a(path: Path, mode: str) -> None:
    """``path`` (and its .data) are checkpoint A, byte for byte, and load as A."""
    ref = path.with_name(path.name + ".ref")
    assert path.read_bytes() == ref.read_bytes(), "the checkpoint file changed"
    if mode == "params":
        assert data_file(path).read_bytes() == Path(str(ref) + ".data").read_bytes(), "the .data file changed"
    assert_same_checkpoint(load_checkpoint(path), expected(1))
    with open_checkpoint(path, verify=True) as r:
        assert r.has_external_data == (mode == "params")
        assert r.checksums is not None and r.checksums.usable  # the record survived the kill with its tensors
        for info in r.tensors():
            r.torch(info)  # verified against its checksum as it is read


# -- a save killed midway ---------------------------------------------------------------------------------------
_KILL_ME_WHILE_SAVING = """
save_a_and_keep_a_copy()
big = big_checkpoint(2)
print("A saved", flush=True)
save_checkpoint(big, path, external_data=mode)
print("B saved", flush=True)
"""


@pytest.mark.parametrize("mode", MODES)
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, mode):
    path = tmp_path / "model.ckpt"
    proc = child(_KILL_ME_WHILE_SAVING, path, mode)
    line = proc.stdout.readline()
    if line != "A saved\n":
        out, err = finish(proc)
        pytest.fail(f"child failed before the big save: {line}{out}\n{err}")
    tmp_re = re.compile(rf"^\.{re.escape(path.name)}(\.data)?\.{proc.pid}\.[0-9a-f]+\.tmp$")
    seen: dict[str, int] = {}
    killed_at = None
    deadline = time.monotonic() + 60
    while killed_at is None and proc.poll() is None and time.monotonic() < deadline:
        for entry in os.scandir(tmp_path):
            if not tmp_re.match(entry.name):
                continue
            try:
                size = entry.stat().st_size
            except FileNotFoundError:
                continue
            if 0 < seen.get(entry.name, 0) < size and size >= 4 << 20:  # exists and is growing
                proc.send_signal(signal.SIGKILL)
                killed_at = (entry.name, size)
                break
            seen[entry.name] = size
        time.sleep(0.001)
    out, err = finish(proc)
    assert killed_at is not None, f"the save finished (or stalled) before it could be killed: {out}\n{err}"
    assert proc.returncode == -signal.SIGKILL
    assert "B saved" not in out

    # The dead save's temporary file is still there; the checkpoint at the path is still A, bit for bit.
    assert leftovers(tmp_path, proc.pid), os.listdir(tmp_path)
    assert_is_a(path, mode)

    # The next save works and sweeps the dead process's leftovers.
    save_checkpoint(small_checkpoint(3), path, external_data=mode)
    atomic.wait_for_cleanup()
    assert leftovers(tmp_path) == []
    assert_same_checkpoint(load_checkpoint(path), expected(3))
    assert data_file(path).exists() == (mode == "params")


# -- a kill inside the two-rename commit of an external-data checkpoint -------------------------------------------
_KILL_ME_DURING_COMMIT = """
save_checkpoint(small_checkpoint(2), path + ".new", external_data=mode)  # what B looks like, for comparison
save_a_and_keep_a_copy()
stage = extra[0]
journal = path + atomic.JOURNAL_SUFFIX
point = {"before-journal": ("before", journal), "after-journal": ("after", journal),
         "after-data": ("after", atomic.data_path(path)), "after-checkpoint": ("after", path)}[stage]
real_replace = os.replace

def replace(src, dst, *args, **kwargs):
    if (("before", os.fspath(dst))) == point:
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst, *args, **kwargs)
    if (("after", os.fspath(dst))) == point:
        os.kill(os.getpid(), signal.SIGKILL)

os.replace = replace
save_checkpoint(small_checkpoint(2), path, external_data=mode)
print("B saved", flush=True)
"""


@pytest.mark.parametrize("stage", ["before-journal", "after-journal", "after-data", "after-checkpoint"])
def test_sigkill_inside_external_data_commit(tmp_path, stage):
    path = tmp_path / "model.ckpt"
    proc = child(_KILL_ME_DURING_COMMIT, path, "params", stage)
    out, err = finish(proc)
    assert proc.returncode == -signal.SIGKILL, f"{out}\n{err}"
    journal = Path(str(path) + atomic.JOURNAL_SUFFIX)
    new = path.with_name(path.name + ".new")
    a_ckpt, a_data = path.with_name(path.name + ".ref").read_bytes(), Path(f"{path}.ref.data").read_bytes()
    b_ckpt, b_data = new.read_bytes(), data_file(new).read_bytes()
    assert a_data != b_data and a_ckpt != b_ckpt

    if stage == "before-journal":  # nothing was committed: A stays, whole
        assert not journal.exists()
        assert_is_a(path, "params")
        want_ckpt, want_data, want = a_ckpt, a_data, expected(1)
    else:
        # The journal is there, and the files on disk are mid-commit (after-data: new .data, old .ckpt).
        assert journal.exists()
        on_disk = (path.read_bytes(), data_file(path).read_bytes())
        assert on_disk == {"after-journal": (a_ckpt, a_data), "after-data": (a_ckpt, b_data),
                           "after-checkpoint": (b_ckpt, b_data)}[stage]
        # Opening completes the commit: the NEW checkpoint with its NEW .data, never a mix.
        with open_checkpoint(path) as r:
            assert r.properties["tag"] == "checkpoint-2"
            for info in r.tensors():
                r.torch(info)
        assert not journal.exists()
        want_ckpt, want_data, want = b_ckpt, b_data, expected(2)
    assert path.read_bytes() == want_ckpt and data_file(path).read_bytes() == want_data
    assert_same_checkpoint(load_checkpoint(path), want)

    # The next save completes normally and sweeps everything the dead process left behind.
    save_checkpoint(small_checkpoint(3), path, external_data="params")
    atomic.wait_for_cleanup()
    assert leftovers(tmp_path) == [], os.listdir(tmp_path)
    assert_same_checkpoint(load_checkpoint(path), expected(3))


def test_interrupted_commit_is_completed_by_the_next_save(tmp_path):
    """A save (not a read) that finds a pending journal completes that commit first, then replaces it."""
    path = tmp_path / "model.ckpt"
    proc = child(_KILL_ME_DURING_COMMIT, path, "params", "after-data")
    out, err = finish(proc)
    assert proc.returncode == -signal.SIGKILL, f"{out}\n{err}"
    save_checkpoint(small_checkpoint(3), path, external_data="never")
    atomic.wait_for_cleanup()
    assert leftovers(tmp_path) == [], os.listdir(tmp_path)
    assert not data_file(path).exists()
    assert_same_checkpoint(load_checkpoint(path), expected(3))


# -- a save that fails --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_tensor_that_fails_midway_keeps_previous_checkpoint(tmp_path, mode):
    path = tmp_path / "model.ckpt"
    save_checkpoint(small_checkpoint(1), path, external_data=mode)
    atomic.wait_for_cleanup()
    before = files_of(tmp_path)
    bad = small_checkpoint(2)
    bad.trainable["a_big"] = torch.ones(2048, 2048)  # written first (names are sorted) ...
    bad.trainable["z_meta"] = torch.empty(1000, 1000, device="meta")  # ... then this one cannot be copied out
    with pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(bad, path, external_data=mode)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and info.value.path == str(path), msg
    assert "meta" in msg and "unchanged" in msg, msg
    assert isinstance(info.value.__cause__, NotImplementedError)
    atomic.wait_for_cleanup()
    assert files_of(tmp_path) == before  # A untouched, no temporary file left
    assert_same_checkpoint(load_checkpoint(path), expected(1))


_HIT_FILE_SIZE_LIMIT = """
save_a_and_keep_a_copy()
big = small_checkpoint(2)
big.trainable["big"] = __import__("torch").ones(1024, 1024)  # 4 MiB
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
try:
    save_checkpoint(big, path, external_data=mode)
    print(json.dumps({"saved": True}))
except BaseException as e:
    print(json.dumps({"type": type(e).__name__, "is_ours": type(e).__module__, "message": str(e),
                      "path": getattr(e, "path", None), "cause": type(e.__cause__).__name__}))
"""


@pytest.mark.parametrize("mode", MODES)
def test_file_size_limit_keeps_previous_checkpoint(tmp_path, mode):
    path = tmp_path / "model.ckpt"
    proc = child(_HIT_FILE_SIZE_LIMIT, path, mode)
    out, err = finish(proc)
    assert proc.returncode == 0, f"{out}\n{err}"
    result = json.loads(out.strip().splitlines()[-1])
    assert result.get("type") == "CheckpointSaveError", result
    assert result["path"] == str(path) and result["message"].startswith(f"{path}: "), result
    assert "too large" in result["message"].lower() and "unchanged" in result["message"], result
    assert leftovers(tmp_path) == [], os.listdir(tmp_path)
    assert_is_a(path, mode)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["model.ckpt", "model.ckpt.ref"] + (["model.ckpt.data", "model.ckpt.ref.data"] if mode == "params" else []))


# -- the free-space pre-check ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_too_little_free_space_writes_nothing(tmp_path, monkeypatch, mode):
    path = tmp_path / "model.ckpt"
    save_checkpoint(small_checkpoint(1), path, external_data=mode)
    atomic.wait_for_cleanup()
    before = files_of(tmp_path)
    stat_before = {n: os.stat(tmp_path / n) for n in before}
    usage = namedtuple("usage", "total used free")
    calls = []

    def little_space(p):
        calls.append(p)
        return usage(10 << 30, (10 << 30) - 100, 100)  # the small checkpoint needs about 2 KB

    monkeypatch.setattr(atomic.shutil, "disk_usage", little_space)
    with pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(small_checkpoint(2), path, external_data=mode)
    msg = str(info.value)
    assert calls, "the pre-check did not ask for the free space"
    assert msg.startswith(f"{path}: ") and info.value.path == str(path), msg
    assert "free disk space" in msg and "100 are free" in msg and "nothing was written" in msg, msg
    assert isinstance(info.value, CheckpointError)
    assert files_of(tmp_path) == before
    for n, st in stat_before.items():
        now = os.stat(tmp_path / n)
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), n
    assert_same_checkpoint(load_checkpoint(path), expected(1))

    monkeypatch.undo()  # with the real free space the same save succeeds
    save_checkpoint(small_checkpoint(2), path, external_data=mode)
    atomic.wait_for_cleanup()
    assert_same_checkpoint(load_checkpoint(path), expected(2))
    assert leftovers(tmp_path) == []
