"""Spares: the newest large retired file of a directory is written over by its next save, not freed and allocated
again (``format/_atomic/_cleanup``), only where nothing can tell: nobody has it open or mapped, it has one name, its
owner may write it. The saves stay whole, exact and atomic; ``drain_deletions`` leaves no hidden file.

Real files, a real second process holding one open; nothing of the format layer is mocked.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.ort_reference import assert_same_checkpoint

from lightning_ort_ckpt.format import CheckpointContents, load_checkpoint, save_checkpoint
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt.format._platform import PORTABLE_IO_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="spares need Linux's write leases")


@pytest.fixture(autouse=True)
def _fast_path(monkeypatch):
    """Spares kept, as a plugin keeps them from its first save to its teardown."""
    monkeypatch.delenv(PORTABLE_IO_ENV, raising=False)
    atomic.wait_for_cleanup()
    let_go = atomic.keep_spares()
    yield
    let_go()
    atomic.wait_for_cleanup()


def contents(seed: int, n: int = 1 << 20) -> CheckpointContents:
    """A checkpoint of about ``4 n`` bytes (above the spare's minimum)."""
    rng = np.random.default_rng(seed)
    return CheckpointContents(trainable={"w": rng.standard_normal(n, dtype=np.float32)}, properties={"seed": seed})


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_removed_checkpoint_is_written_over_by_the_next_save_which_loads_exactly(tmp_path: Path) -> None:
    old, new, newer = tmp_path / "step=1.ckpt", tmp_path / "step=2.ckpt", tmp_path / "step=3.ckpt"
    save_checkpoint(contents(1), old)
    inode = os.stat(old).st_ino
    atomic.remove(str(old))
    save_checkpoint(contents(2, 1 << 18), new)  # smaller: the rest of the old file is cut off
    assert os.stat(new).st_ino == inode
    assert_same_checkpoint(load_checkpoint(new), contents(2, 1 << 18))
    atomic.remove(str(new))
    save_checkpoint(contents(3, 3 << 20), newer)  # larger: it grows
    assert os.stat(newer).st_ino == inode
    assert_same_checkpoint(load_checkpoint(newer), contents(3, 3 << 20))
    assert atomic.drain_deletions() is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=3.ckpt"]


def test_a_replaced_checkpoint_is_written_over_by_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    save_checkpoint(contents(1), path)
    first = os.stat(path).st_ino
    save_checkpoint(contents(2), path)  # the first file retired: a spare
    assert hidden(tmp_path) != [] and os.stat(path).st_ino != first
    save_checkpoint(contents(3), path)
    assert os.stat(path).st_ino == first
    assert_same_checkpoint(load_checkpoint(path), contents(3))
    assert atomic.drain_deletions() is True and hidden(tmp_path) == []


def _open_in(pid: int, path: Path) -> str | None:
    """The ``/proc`` link of the descriptor by which process ``pid`` has ``path`` open, if it has (a descriptor its
    interpreter closes while it starts is passed over)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return f"/proc/{pid}/fd/{fd}"
        except OSError:
            continue
    return None


def test_a_retired_file_another_process_reads_is_not_written_over(tmp_path: Path) -> None:
    old, new = tmp_path / "step=1.ckpt", tmp_path / "step=2.ckpt"
    save_checkpoint(contents(1), old)
    before = old.read_bytes()
    reader = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1], 'rb'); sys.stdin.read()",
                               str(old)], stdin=subprocess.PIPE)
    try:
        fd_path = None
        while fd_path is None:  # until the reader has it open
            fd_path = _open_in(reader.pid, old)
        atomic.remove(str(old))
        save_checkpoint(contents(2), new)
        with open(fd_path, "rb") as again:  # the reader's open file: still the bytes that were saved
            assert again.read() == before
    finally:
        reader.communicate(b"")
    assert_same_checkpoint(load_checkpoint(new), contents(2))
    assert atomic.drain_deletions() is True and hidden(tmp_path) == []


def test_a_retired_file_mapped_here_is_not_written_over(tmp_path: Path) -> None:
    old, new = tmp_path / "step=1.ckpt", tmp_path / "step=2.ckpt"
    save_checkpoint(contents(1), old)
    with open(old, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        before = bytes(view)
        atomic.remove(str(old))
        save_checkpoint(contents(2), new)
        assert bytes(view) == before
    finally:
        view.close()
    assert_same_checkpoint(load_checkpoint(new), contents(2))


def test_a_retired_file_with_another_name_or_read_only_is_no_spare(tmp_path: Path) -> None:
    linked, read_only = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    save_checkpoint(contents(1), linked)
    os.link(linked, tmp_path / "elsewhere")
    before = (tmp_path / "elsewhere").read_bytes()
    atomic.remove(str(linked))
    assert atomic._UNLINKER._spares == {}
    save_checkpoint(contents(2), tmp_path / "c.ckpt")
    assert (tmp_path / "elsewhere").read_bytes() == before
    save_checkpoint(contents(3), read_only)
    os.chmod(read_only, 0o444)
    atomic.remove(str(read_only))
    assert atomic._UNLINKER._spares == {}


def test_the_portable_path_keeps_no_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORTABLE_IO_ENV, "1")
    save_checkpoint(contents(1), tmp_path / "step=1.ckpt")
    atomic.remove(str(tmp_path / "step=1.ckpt"))
    assert atomic._UNLINKER._spares == {}




ALONE = r"""
import os, sys, time
import numpy as np
from lightning_ort_ckpt.format import CheckpointContents, save_checkpoint
from lightning_ort_ckpt.format import _atomic as atomic

folder = sys.argv[1]
path = os.path.join(folder, "last.ckpt")


def contents(seed):
    return CheckpointContents(trainable={"w": np.full(1 << 20, seed, dtype=np.float32)})


def hidden():
    for _ in range(600):  # until the unlink thread is idle (the bound catches a hang only)
        names = [n for n in os.listdir(folder) if n.startswith(".")]
        if not names:
            break
        time.sleep(0.1)
    return names


first, second = atomic.keep_spares(), atomic.keep_spares()  # two holders (two plugins between first save and teardown)
save_checkpoint(contents(1), path)
save_checkpoint(contents(2), path)  # the first file retired: kept
first()
kept = [n for n in os.listdir(folder) if n.startswith(".")]
second()
after_last = hidden()  # the last holder let go: the spare is deleted
save_checkpoint(contents(3), path)  # nobody keeps spares: the second file is deleted, not kept
print(len(kept), len(after_last), len(hidden()))
"""


def test_a_save_no_one_keeps_spares_for_leaves_none(tmp_path: Path) -> None:
    """In a process of its own (no other holder): a spare is kept while a holder is left, deleted when the last
    one lets go, and a save nobody keeps spares for (a single call) leaves no hidden file, without a drain."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    env.pop(PORTABLE_IO_ENV, None)
    out = subprocess.run([sys.executable, "-c", ALONE, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0", "0"], out.stdout
    assert_same_checkpoint(load_checkpoint(tmp_path / "last.ckpt"),
                           CheckpointContents(trainable={"w": np.full(1 << 20, 3, dtype=np.float32)}))
