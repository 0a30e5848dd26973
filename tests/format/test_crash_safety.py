"""Never lose data: a save that is killed, fails, or finds too little disk leaves the previous checkpoint intact.

Kills are real: a child Python process (forked from ``tests/helpers/forkserver.py``, torch imported once) saves, and is
SIGKILLed by the parent (or by itself at a chosen point of the commit). Nothing in the format layer is mocked except
``shutil.disk_usage`` for the free-space pre-check.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from helpers.ort_reference import assert_same_checkpoint

from lightning_ort_ckpt import CheckpointError, CheckpointSaveError
from lightning_ort_ckpt.format import load_checkpoint, open_checkpoint, save_checkpoint
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt.format._atomic import _cleanup, _commit
from lightning_ort_ckpt.format._platform import PORTABLE_IO_ENV, portable_io
from helpers.crash import _PRELUDE, child, dead_pid, expected, finish, leftovers, small_checkpoint, snapshot

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
MODES = ["never", "params"]  # inline, and parameters in <path>.data
HOST_BOOT = "[0-9a-f]{8}-[0-9a-f]{8}"  # the host and boot tag in every temporary name


# -- checkpoints (also imported by the child processes) ---------------------------------------------------------


def data_file(path: Path) -> Path:
    return Path(atomic.data_path(str(path)))


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def assert_dead_process_swept(directory: Path, pid: int) -> None:
    """After the next save, nothing is left over; except, on the portable I/O path (no pid probing, as on Windows),
    the dead process's temporaries, which wait for ``_cleanup.STALE_AGE_S`` since nothing tells that it is dead."""
    left = leftovers(directory)
    if portable_io():
        assert left == leftovers(directory, pid), os.listdir(directory)
    else:
        assert left == [], os.listdir(directory)


# -- child processes --------------------------------------------------------------------------------------------


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


@pytest.mark.usefixtures("io_path")
@pytest.mark.parametrize("mode", MODES)
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, mode):
    path = tmp_path / "model.ckpt"
    proc = child(_KILL_ME_WHILE_SAVING, path, mode)
    line = proc.stdout.readline()
    if line != "A saved\n":
        out, err = finish(proc)
        pytest.fail(f"child failed before the big save: {line}{out}\n{err}")
    tmp_re = re.compile(rf"^\.{re.escape(path.name)}(\.data)?\.{HOST_BOOT}\.{proc.pid}\.[0-9a-f]+\.tmp$")
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
    assert_dead_process_swept(tmp_path, proc.pid)
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


@pytest.mark.usefixtures("io_path")
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
        # Readers change nothing: they read the whole pair the journal describes, never a mix. Until the new
        # .data is in place that is the OLD pair (A); from then on the NEW one (B), its .ckpt still a temporary.
        before = snapshot(tmp_path)
        seen = "checkpoint-1" if stage == "after-journal" else "checkpoint-2"
        with open_checkpoint(path) as r:
            assert r.properties["tag"] == seen
            for info in r.tensors():
                r.torch(info)
        assert_same_checkpoint(load_checkpoint(path), expected(1 if stage == "after-journal" else 2))
        assert snapshot(tmp_path) == before and journal.exists()
        # The next writer (here: the explicit repair) completes the commit: B, whole.
        assert atomic.repair(path) is True
        assert not journal.exists()
        want_ckpt, want_data, want = b_ckpt, b_data, expected(2)
    assert path.read_bytes() == want_ckpt and data_file(path).read_bytes() == want_data
    assert_same_checkpoint(load_checkpoint(path), want)

    # The next save completes normally and sweeps everything the dead process left behind.
    save_checkpoint(small_checkpoint(3), path, external_data="params")
    atomic.wait_for_cleanup()
    assert_dead_process_swept(tmp_path, proc.pid)
    assert_same_checkpoint(load_checkpoint(path), expected(3))


@pytest.mark.usefixtures("io_path")
def test_interrupted_commit_is_completed_by_the_next_save(tmp_path):
    """A save (not a read) that finds a pending journal completes that commit first, then replaces it."""
    path = tmp_path / "model.ckpt"
    proc = child(_KILL_ME_DURING_COMMIT, path, "params", "after-data")
    out, err = finish(proc)
    assert proc.returncode == -signal.SIGKILL, f"{out}\n{err}"
    save_checkpoint(small_checkpoint(3), path, external_data="never")
    atomic.wait_for_cleanup()
    assert_dead_process_swept(tmp_path, proc.pid)
    assert not data_file(path).exists()
    assert_same_checkpoint(load_checkpoint(path), expected(3))


# -- a save that fails --------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("io_path")
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


@pytest.mark.usefixtures("io_path")
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
@pytest.mark.usefixtures("io_path")
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

    monkeypatch.setattr(_commit.shutil, "disk_usage", little_space)
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


# -- leftovers of other hosts, live saves and older versions are not swept ---------------------------------------------


@pytest.mark.parametrize("portable", [False, True])
def test_stale_sweep_deletes_only_what_is_certainly_dead(tmp_path, monkeypatch, portable):
    """A shared file system: another host's in-flight save has temporaries here too, with a pid that means nothing
    on this host. Only this host's dead saves (a dead pid of this boot, or any pid of an earlier boot) are swept;
    the rest only past a generous age. With portable I/O (no pid probing) this host's dead pids wait for that age."""
    if portable:
        monkeypatch.setenv(PORTABLE_IO_ENV, "1")
    else:  # whatever the environment of the test run says
        monkeypatch.delenv(PORTABLE_IO_ENV, raising=False)
    host, boot, pid = atomic._HOST, atomic._BOOT, dead_pid()
    other_host = "0" * 8 if host != "0" * 8 else "1" * 8
    other_boot = "f" * 8 if boot != "f" * 8 else "e" * 8
    names = {  # name -> swept at once, swept past the age limit
        f".a.ckpt.{host}-{boot}.{pid}.0123abcd.tmp": (not portable, True),  # this host, a dead process
        f".a.ckpt.data.{host}-{boot}.{os.getpid()}.0123abcd.tmp": (False, False),  # this process: in flight
        f".a.ckpt.{host}-{boot}.1.0123abcd.old": (False, portable),  # pid 1 lives (probed unless portable)
        f".a.ckpt.{other_host}-{boot}.{pid}.0123abcd.tmp": (False, True),  # another host: its pid means nothing
        f".a.ckpt.{host}-{other_boot}.{pid}.0123abcd.old": (True, True),  # an earlier boot of this host
        f".a.ckpt.{pid}.0123abcd.tmp": (False, True),  # named by an older version: no host tag
        ".notes.txt.old": (False, False), "a.ckpt.tmp": (False, False),  # not ours
    }
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    path = tmp_path / "model.ckpt"
    save_checkpoint(small_checkpoint(1), path, external_data="params")
    atomic.wait_for_cleanup()
    assert sorted(n for n, (now, _) in names.items() if not (tmp_path / n).exists()) == \
        sorted(n for n, (now, _) in names.items() if now)
    monkeypatch.setattr(_cleanup, "STALE_AGE_S", -1.0)  # everything is "old" now
    save_checkpoint(small_checkpoint(2), path, external_data="params")
    atomic.wait_for_cleanup()
    assert sorted(n for n in names if not (tmp_path / n).exists()) == \
        sorted(n for n, (now, aged) in names.items() if now or aged)
    assert_same_checkpoint(load_checkpoint(path), expected(2))


# -- ENOSPC while the journal is written ------------------------------------------------------------------------------
def fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.mark.usefixtures("io_path")
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd to name an fsync's file")
def test_enospc_writing_the_journal_removes_both_temporaries(tmp_path, monkeypatch):
    """The disk fills up exactly when the journal is written (its fsync fails with ENOSPC, as a delayed allocation
    does): both finished temporaries and the journal's own temporary are removed, A stays whole."""
    path = tmp_path / "model.ckpt"
    save_checkpoint(small_checkpoint(1), path, external_data="params")
    atomic.wait_for_cleanup()
    before = snapshot(tmp_path)
    real_fsync, failed = os.fsync, []

    def fsync(fd):
        if ".commit." in os.path.basename(fd_path(fd)):
            failed.append(fd_path(fd))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(small_checkpoint(2), path, external_data="params")
    monkeypatch.undo()
    assert failed and "No space left" in str(info.value) and "unchanged" in str(info.value), info.value
    atomic.wait_for_cleanup()
    assert snapshot(tmp_path) == before, sorted(os.listdir(tmp_path))
    assert_same_checkpoint(load_checkpoint(path), expected(1))


# -- the durability order, seen from inside and by strace ----------------------------------------------------------
@pytest.mark.usefixtures("io_path")
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd to name an fsync's file")
def test_directories_a_save_creates_are_made_durable(tmp_path, monkeypatch):
    events = []
    real_fsync, real_mkdir = os.fsync, os.mkdir

    def fsync(fd):
        events.append(("fsync", fd_path(fd)))
        real_fsync(fd)

    def mkdir(p, *args, **kwargs):
        real_mkdir(p, *args, **kwargs)
        events.append(("mkdir", os.fspath(p)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "mkdir", mkdir)
    path = tmp_path / "runs" / "7" / "model.ckpt"
    save_checkpoint(small_checkpoint(1), path, external_data="params")
    monkeypatch.undo()
    runs, seven = str(tmp_path / "runs"), str(tmp_path / "runs" / "7")
    assert events[:4] == [("mkdir", runs), ("fsync", str(tmp_path)), ("mkdir", seven), ("fsync", runs)], events
    assert events[-1] == ("fsync", seven)  # the commit's renames made durable
    assert_same_checkpoint(load_checkpoint(path), expected(1))


_SAVE_TWICE = """
from lightning_ort_ckpt.format import save_checkpoint
save_checkpoint(small_checkpoint(1), path, external_data=mode)  # creates its directory
save_checkpoint(small_checkpoint(2), path, external_data=mode)  # replaces A with B
"""


@pytest.mark.usefixtures("io_path")
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_syscall_order_of_an_external_data_save(tmp_path):
    """strace of two saves: the new directory is fsynced into its parent; for the replacing save, both temporaries
    are fsynced before the journal, the journal is durable before the first rename, .data is renamed before the
    .ckpt, the directory is fsynced after both, and only then is the journal removed."""
    path = tmp_path / "new" / "model.ckpt"
    log = tmp_path / "strace.log"
    code = _PRELUDE + textwrap.dedent(_SAVE_TWICE)
    proc = subprocess.run(["strace", "-f", "-qq", "-y", "-o", str(log), "-e",
                           "trace=mkdir,mkdirat,fsync,rename,renameat,renameat2,link,linkat,unlink,unlinkat",
                           sys.executable, "-c", code, str(path), "params"], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    d, name = str(path.parent), path.name
    calls = []
    for line in log.read_text().splitlines():
        m = re.match(r"^\d+\s+(\w+)\((.*)\)\s+=\s+(-?\d+)", line)
        if m and m.group(3) == "0":
            calls.append((m.group(1), m.group(2)))

    def index(syscalls: tuple[str, ...], *needles: str, start: int = 0) -> int:
        for i in range(start, len(calls)):
            if calls[i][0] in syscalls and all(n in calls[i][1] for n in needles):
                return i
        raise AssertionError(f"no {syscalls} with {needles} after call {start}:\n" + "\n".join(map(str, calls)))

    mk = index(("mkdir", "mkdirat"), d)
    assert index(("fsync",), f"<{tmp_path}>", start=mk) < index(("fsync",), f".{name}.", start=mk)
    renames = ("rename", "renameat", "renameat2")
    first_commit = index(("unlink", "unlinkat"), f"{name}.commit")
    # the second save, from its temporaries' fsyncs to the journal's removal
    sync_main = index(("fsync",), f"/.{name}.", ".tmp>", start=first_commit)
    sync_data = index(("fsync",), f"/.{name}.data.", ".tmp>", start=first_commit)
    journal_sync = index(("fsync",), f"/.{name}.commit.", start=first_commit)
    journal_in_place = index(renames, f"{name}.commit\"", start=journal_sync)
    journal_dir_sync = index(("fsync",), f"<{d}>", start=journal_in_place)
    retire_data = index(("link", "linkat"), f"{name}.data\"", ".old", start=journal_dir_sync)
    data_in_place = index(renames, f"/.{name}.data.", f"{name}.data\"", start=journal_dir_sync)
    retire_main = index(("link", "linkat"), f"/{name}\"", ".old", start=data_in_place)
    main_in_place = index(renames, f"/.{name}.", f"/{name}\"", start=data_in_place)
    dir_sync = index(("fsync",), f"<{d}>", start=main_in_place)
    journal_gone = index(("unlink", "unlinkat"), f"{name}.commit\"", start=dir_sync)
    assert max(sync_main, sync_data) < journal_sync < journal_in_place < journal_dir_sync
    assert journal_dir_sync < retire_data < data_in_place < retire_main < main_in_place < dir_sync < journal_gone
    assert_same_checkpoint(load_checkpoint(path), expected(2))


# -- removal: all or nothing for a reader ------------------------------------------------------------------------------
@pytest.mark.usefixtures("io_path")
def test_removal_hides_the_checkpoint_before_its_data(tmp_path, monkeypatch):
    """A reader that looks between the renames of a removal finds no checkpoint, never a .ckpt without its .data."""
    path = tmp_path / "model.ckpt"
    save_checkpoint(small_checkpoint(1), path, external_data="params")
    real_replace, seen = os.replace, []

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        try:
            load_checkpoint(path)
            seen.append((os.path.basename(src), "loaded"))
        except CheckpointError as e:
            seen.append((os.path.basename(src), str(e)))

    monkeypatch.setattr(os, "replace", replace)
    atomic.remove(str(path))
    monkeypatch.undo()
    assert [s for s, _ in seen] == ["model.ckpt", "model.ckpt.data"], seen
    assert all("no such checkpoint file" in outcome for _, outcome in seen), seen
    atomic.wait_for_cleanup()
    assert os.listdir(tmp_path) == []


# -- a real full disk and a read-only mount (tmpfs in a private mount namespace) --------------------------------------
_ON_TMPFS = """
import errno, subprocess
from pathlib import Path
from lightning_ort_ckpt import CheckpointError
from lightning_ort_ckpt.format import load_checkpoint, open_checkpoint
from lightning_ort_ckpt._command._cli import main as cli
mnt = Path(path).parent
if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]).returncode != 0:
    print(json.dumps({"skip": "mounting a tmpfs was refused"}))
    raise SystemExit(0)
out = {}
page = os.statvfs(mnt).f_frsize
pages = lambda p: -(-os.path.getsize(p) // page)

def outcome(fn):
    try:
        fn()
        return "ok"
    except CheckpointError as e:
        return f"{type(e).__name__}: {e}"

if extra[0] == "enospc":
    # B's two files would fit, the journal would not: fill the disk up to exactly B's pages.
    save_checkpoint(small_checkpoint(2), str(mnt / "b.ckpt"), external_data="params")
    need = pages(mnt / "b.ckpt") + pages(mnt / "b.ckpt.data")
    atomic.remove(str(mnt / "b.ckpt"))
    save_a_and_keep_a_copy()
    atomic.wait_for_cleanup()
    st = os.statvfs(mnt)
    with open(mnt / "filler", "wb") as f:
        f.write(b"\\0" * ((st.f_bavail - need) * page))
    free_before, names_before = os.statvfs(mnt).f_bavail, sorted(os.listdir(mnt))
    journal_writes = []
    real = _commit._write_durably
    def recorded(*args, **kwargs):
        journal_writes.append(args[0])
        return real(*args, **kwargs)
    _commit._write_durably = recorded
    out["save"] = outcome(lambda: save_checkpoint(small_checkpoint(2), path, external_data="params"))
    atomic.wait_for_cleanup()
    out["journal_writes"] = journal_writes
    out["same_names"] = sorted(os.listdir(mnt)) == names_before
    out["space_back"] = os.statvfs(mnt).f_bavail == free_before
    out["a"] = load_checkpoint(path).properties["tag"]
else:
    # A dead writer's commit after its new .data is in place; then the mount goes read-only.
    save_a_and_keep_a_copy()
    save_checkpoint(small_checkpoint(2), str(mnt / "b.ckpt"), external_data="params")
    token = _names.token()
    tmp_main, tmp_data = f".model.ckpt.{token}.tmp", f".model.ckpt.data.{token}.tmp"
    os.replace(mnt / "b.ckpt", mnt / tmp_main)
    os.replace(mnt / "b.ckpt.data", mnt / "model.ckpt.data")
    (mnt / "model.ckpt.commit").write_text(json.dumps({"checkpoint": tmp_main, "data": tmp_data}))
    assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)]).returncode == 0
    names_before = sorted(os.listdir(mnt))
    out["load"] = load_checkpoint(path).properties["tag"]
    with open_checkpoint(path) as r:
        out["open"] = r.properties["tag"]
    out["inspect"] = cli(["inspect", path])
    out["save"] = outcome(lambda: save_checkpoint(small_checkpoint(3), path, external_data="params"))
    out["repair"] = outcome(lambda: atomic.repair(path))
    out["unchanged"] = sorted(os.listdir(mnt)) == names_before
    out["names"] = names_before
print(json.dumps(out))
"""


def on_tmpfs(tmp_path: Path, scenario: str) -> dict:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare is not installed")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = _PRELUDE + textwrap.dedent(_ON_TMPFS)
    proc = subprocess.run([unshare, "-m" if os.geteuid() == 0 else "-rm", sys.executable, "-c", code,
                           str(mnt / "model.ckpt"), "params", scenario], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "unshare failed" in proc.stderr:
        pytest.skip(f"no private mount namespace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result


@pytest.mark.usefixtures("io_path")
def test_real_enospc_at_the_journal_cleans_both_temporaries(tmp_path):
    r = on_tmpfs(tmp_path, "enospc")
    # the temporaries fit: the failure came at the journal (with portable I/O, at the writers' lock file before it)
    assert r["journal_writes"] or portable_io(), r
    assert r["save"].startswith("CheckpointSaveError") and "No space left" in r["save"], r
    assert r["same_names"] and r["space_back"], r
    assert r["a"] == "checkpoint-1"


@pytest.mark.usefixtures("io_path")
def test_read_only_mount_with_a_pending_commit(tmp_path):
    """Readers need no write access: a pending commit on a read-only mount reads as the new pair, whole; a save and
    a repair fail clearly, and nothing changes."""
    r = on_tmpfs(tmp_path, "read-only")
    assert r["load"] == r["open"] == "checkpoint-2" and r["inspect"] == 0, r
    for what in ("save", "repair"):
        assert r[what].startswith(("CheckpointSaveError", "CorruptCheckpointError")), r
        assert "Read-only" in r[what], r
    assert r["unchanged"] and "model.ckpt.commit" in r["names"], r
