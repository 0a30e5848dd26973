"""The local commit's limits: long names, the cost of the leftover sweep, and deletions still running when a run ends.

- Names: every name derived from a checkpoint's (temporaries, the journal, retired ``.old`` files) fits wherever the
  checkpoint's own name fits; a ``.data`` name that cannot fit is refused before anything is written.
- The sweep lists a directory once per process, however many saves follow (counted by wrapping ``os.scandir`` and
  ``os.listdir``), and still sweeps what a killed earlier run left.
- ``drain_deletions`` returns once the hidden ``.old`` files of replaced and removed checkpoints are gone.

Kills are real (child processes, as in ``test_crash_safety``); nothing of the format layer is mocked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers.crash import child, dead_pid, expected, finish, leftovers, small_checkpoint
from helpers.ort_reference import assert_same_checkpoint

from lightning_ort_ckpt import CheckpointSaveError
from lightning_ort_ckpt.format import load_checkpoint, save_checkpoint
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt.format._platform import PORTABLE_IO_ENV


@pytest.fixture(autouse=True)
def _pid_probing(monkeypatch):
    """Which leftovers are dead is told by probing pids, which the portable I/O path does not do."""
    monkeypatch.delenv(PORTABLE_IO_ENV, raising=False)


def name_max(directory: Path) -> int:
    return os.pathconf(directory, "PC_NAME_MAX")


def name_of(size: int, char: str = "a") -> str:
    """A checkpoint file name of ``size`` bytes (``char`` may take several bytes: the rest is ASCII)."""
    stem = char * ((size - 5) // len(char.encode()))
    return stem + "x" * (size - 5 - len(stem.encode())) + ".ckpt"


def on_disk(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# -- item 9: names up to the file system's limit ------------------------------------------------------------------
@pytest.mark.parametrize("size,char,mode", [(213, "a", "params"), (250, "a", "params"), (250, "é", "params"),
                                            (251, "a", "never"), (255, "a", "never"), (255, "€", "auto")])
def test_names_up_to_the_limit_save_replace_link_and_remove(tmp_path, size, char, mode):
    """A name that fits (with its ``.data`` where there is one) is saved, replaced, linked to and removed: the
    temporaries, the journal and the retired files are named to fit, cut where needed in whole characters."""
    assert name_max(tmp_path) == 255
    path, linkpath = tmp_path / name_of(size, char), tmp_path / name_of(size, "l")
    assert len(os.fsencode(path.name)) == size
    save_checkpoint(small_checkpoint(1), path, external_data=mode)
    save_checkpoint(small_checkpoint(2), path, external_data=mode)  # replaces: the old pair gets .old names
    atomic.wait_for_cleanup()
    assert sorted(os.listdir(tmp_path)) == [path.name, path.name + ".data"][:2 if mode == "params" else 1]
    assert_same_checkpoint(load_checkpoint(path), expected(2))
    atomic.link(str(path), str(linkpath))
    assert_same_checkpoint(load_checkpoint(linkpath), expected(2))
    atomic.remove(str(linkpath))
    atomic.remove(str(path))
    atomic.wait_for_cleanup()
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("size", [251, 255])
def test_a_data_name_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, size):
    """ORT names the external data file ``<name>.data``; that name cannot be cut short, so a checkpoint name it
    would make too long is refused, naming the path and the limit, and the previous checkpoint stays."""
    path = tmp_path / name_of(size)
    save_checkpoint(small_checkpoint(1), path, external_data="never")
    atomic.wait_for_cleanup()
    before = on_disk(tmp_path)
    with pytest.raises(CheckpointSaveError) as info:
        save_checkpoint(small_checkpoint(2), path, external_data="params")
    msg = str(info.value)
    assert info.value.path == str(path) and msg.startswith(f"{path}: "), msg
    assert f"would be {size + 5} bytes long" in msg and "at most 250 bytes" in msg and "nothing was written" in msg
    short = tmp_path / "short.ckpt"
    save_checkpoint(small_checkpoint(3), short, external_data="params")
    with pytest.raises(CheckpointSaveError, match="at most 250 bytes"):  # a link to a checkpoint with .data
        atomic.link(str(short), str(tmp_path / name_of(size, "l")))
    atomic.wait_for_cleanup()
    after = on_disk(tmp_path)
    assert {n: b for n, b in after.items() if not n.startswith("short.ckpt")} == before
    assert_same_checkpoint(load_checkpoint(path), expected(1))


def test_a_name_longer_than_the_limit_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / name_of(256)
    with pytest.raises(CheckpointSaveError, match="256 bytes long and this file system allows at most 255") as info:
        save_checkpoint(small_checkpoint(1), path, external_data="never")
    assert info.value.path == str(path) and "nothing was written" in str(info.value)
    assert os.listdir(tmp_path) == []


_KILL_ME_AFTER_THE_DATA_RENAME = """
save_checkpoint(small_checkpoint(1), path, external_data=mode)
real_replace = os.replace

def replace(src, dst, *args, **kwargs):
    real_replace(src, dst, *args, **kwargs)
    if os.fspath(dst) == atomic.data_path(path):
        os.kill(os.getpid(), signal.SIGKILL)

os.replace = replace
save_checkpoint(small_checkpoint(2), path, external_data=mode)
"""


def test_a_long_named_commit_killed_between_its_renames_is_completed(tmp_path):
    """250 bytes: ``<name>.commit`` would be 257, so the journal (and its temporaries') names are cut short; a
    reader still finds the journal and reads the new pair, and the next writer completes it and sweeps the rest."""
    path = tmp_path / name_of(250)
    proc = child(_KILL_ME_AFTER_THE_DATA_RENAME, path, "params")
    out, err = finish(proc)
    assert proc.returncode == -signal.SIGKILL, f"{out}\n{err}"
    journals = [n for n in os.listdir(tmp_path) if n.endswith(atomic.JOURNAL_SUFFIX)]
    assert len(journals) == 1 and len(os.fsencode(journals[0])) == 255 and "~" in journals[0], journals
    assert all(len(os.fsencode(n)) <= 255 for n in os.listdir(tmp_path))
    assert_same_checkpoint(load_checkpoint(path), expected(2))  # the new .data is in place: the new pair
    assert atomic.repair(path) is True
    atomic.wait_for_cleanup()
    assert sorted(os.listdir(tmp_path)) == sorted([path.name, path.name + ".data"])
    assert_same_checkpoint(load_checkpoint(path), expected(2))


def test_the_sweep_recognises_cut_leftover_names(tmp_path):
    """Leftovers with names cut short are swept like any: a dead process's at once, a live one's not."""
    path = tmp_path / name_of(250)
    dead, alive = dead_pid(), os.getpid()
    names = {}
    for pid in (dead, alive):
        for p, suffix in ((path, "tmp"), (Path(atomic.data_path(str(path))), "old")):
            token = f"{atomic._HOST}-{atomic._BOOT}.{pid}.0123abcd"
            name = os.path.basename(atomic._hidden_name(str(p), token, suffix))
            assert len(os.fsencode(name)) == 255 and "~" in name
            (tmp_path / name).write_bytes(b"x")
            names[name] = pid == dead
    save_checkpoint(small_checkpoint(1), path, external_data="params")
    atomic.wait_for_cleanup()
    assert sorted(n for n in names if not (tmp_path / n).exists()) == sorted(n for n, d in names.items() if d)


# -- item 10: one listing per directory and process ---------------------------------------------------------------
@pytest.fixture
def listings(tmp_path, monkeypatch) -> list[str]:
    """Every listing of ``tmp_path`` the package makes in this process, by ``os.scandir`` or ``os.listdir``."""
    seen: list[str] = []
    for fn in ("scandir", "listdir"):
        real = getattr(os, fn)

        def counting(directory=".", _real=real, _fn=fn):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("lightning_ort_ckpt") and isinstance(directory, (str, os.PathLike)) \
                    and os.path.abspath(directory) == str(tmp_path):
                seen.append(_fn)
            return _real(directory)

        monkeypatch.setattr(os, fn, counting)
    return seen


def test_many_saves_list_the_directory_once(tmp_path, listings):
    """A directory of 2,000 foreign files and a dead save's leftover: the first save lists it and sweeps the
    leftover; the nine saves, links and removals after it list nothing."""
    for i in range(2000):
        (tmp_path / f"foreign-{i}.txt").write_bytes(b"")
    dead = f".a.ckpt.{atomic._HOST}-{atomic._BOOT}.{dead_pid()}.0123abcd.tmp"
    (tmp_path / dead).write_bytes(b"x")
    for step in range(1, 11):
        path = tmp_path / f"epoch={step}.ckpt"
        save_checkpoint(small_checkpoint(step), path, external_data="params" if step % 2 else "never")
        save_checkpoint(small_checkpoint(step), tmp_path / "same.ckpt", external_data="params")
        atomic.link(str(path), str(tmp_path / "last.ckpt"))
        if step > 2:
            atomic.remove(str(tmp_path / f"epoch={step - 2}.ckpt"))
    atomic.wait_for_cleanup()
    assert listings == ["scandir"]
    assert not (tmp_path / dead).exists()
    assert leftovers(tmp_path) == []


def test_a_leftover_that_had_to_wait_is_swept_without_a_new_listing(tmp_path, listings):
    """A live process's leftover stays; once that process has ended, the next save sweeps it, from the names the
    first listing kept, without listing the directory again."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        name = f".a.ckpt.{atomic._HOST}-{atomic._BOOT}.{proc.pid}.0123abcd.old"
        (tmp_path / name).write_bytes(b"x")
        path = tmp_path / "model.ckpt"
        save_checkpoint(small_checkpoint(1), path, external_data="params")
        atomic.wait_for_cleanup()
        assert (tmp_path / name).exists()
    finally:
        proc.communicate(b"")
    save_checkpoint(small_checkpoint(2), path, external_data="params")
    atomic.wait_for_cleanup()
    assert not (tmp_path / name).exists()
    assert listings == ["scandir"]


_KILL_ME_BEFORE_THE_JOURNAL = """
real_replace = os.replace

def replace(src, dst, *args, **kwargs):
    if os.fspath(dst) == path + atomic.JOURNAL_SUFFIX:
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst, *args, **kwargs)

os.replace = replace
save_checkpoint(small_checkpoint(2), path, external_data=mode)
"""


def test_what_a_run_killed_meanwhile_left_is_swept_by_the_next_run(tmp_path, listings):
    """The bound of one listing: leftovers of another process killed after this one listed the directory stay until
    a later run's first save there (here a fresh process), which sweeps them."""
    path = tmp_path / "model.ckpt"
    save_checkpoint(small_checkpoint(1), path, external_data="params")
    proc = child(_KILL_ME_BEFORE_THE_JOURNAL, tmp_path / "other.ckpt", "params")
    out, err = finish(proc)
    assert proc.returncode == -signal.SIGKILL, f"{out}\n{err}"
    left = leftovers(tmp_path, proc.pid)
    assert len(left) == 3, os.listdir(tmp_path)  # its .ckpt and .data temporaries, and the journal's
    save_checkpoint(small_checkpoint(2), path, external_data="params")
    atomic.wait_for_cleanup()
    assert leftovers(tmp_path) == left and listings == ["scandir"]
    next_run = child("save_checkpoint(small_checkpoint(3), path, external_data=mode)", path, "params")
    out, err = finish(next_run)
    assert next_run.returncode == 0, f"{out}\n{err}"
    assert leftovers(tmp_path) == []
    assert_same_checkpoint(load_checkpoint(path), expected(3))


_KILL_ME_BETWEEN_THE_RENAMES = _KILL_ME_AFTER_THE_DATA_RENAME.replace(
    "save_checkpoint(small_checkpoint(1), path, external_data=mode)\n", "")


def test_completing_a_dead_writers_commit_lists_the_directory_again(tmp_path, listings):
    """A commit completed for a writer that died during this run is evidence of what else it left: the save after
    that lists the directory again and sweeps it."""
    path = tmp_path / "model.ckpt"
    save_checkpoint(small_checkpoint(1), path, external_data="params")
    proc = child(_KILL_ME_BETWEEN_THE_RENAMES, path, "params")
    out, err = finish(proc)
    assert proc.returncode == -signal.SIGKILL, f"{out}\n{err}"
    assert leftovers(tmp_path, proc.pid), os.listdir(tmp_path)
    save_checkpoint(small_checkpoint(3), path, external_data="params")  # completes the dead commit, then its own
    save_checkpoint(small_checkpoint(4), path, external_data="params")  # lists again
    atomic.wait_for_cleanup()
    assert listings == ["scandir", "scandir"]
    assert leftovers(tmp_path) == []
    assert_same_checkpoint(load_checkpoint(path), expected(4))


# -- item 12: deletions still running when training ends -----------------------------------------------------------
def test_drain_deletions_waits_until_no_hidden_old_file_is_left(tmp_path, monkeypatch):
    """Replaced and removed files are unlinked on a background thread; held there (a slow disk), their hidden
    ``.old`` names are still in the folder, ``drain_deletions`` with a timeout says so, and without one it returns
    only once they are gone."""
    atomic.wait_for_cleanup()
    path, other = tmp_path / "model.ckpt", tmp_path / "other.ckpt"
    save_checkpoint(small_checkpoint(1), path, external_data="params")
    save_checkpoint(small_checkpoint(1), other, external_data="never")
    atomic.wait_for_cleanup()
    gate, real_unlink = threading.Event(), atomic._UNLINKER._unlink

    def slow_unlink(p: str) -> None:
        if os.path.basename(p) != "nothing":  # the thread's wake-up item below passes at once
            gate.wait(60)
        real_unlink(p)

    monkeypatch.setattr(atomic._UNLINKER, "_unlink", slow_unlink)
    atomic._UNLINKER.put(str(tmp_path / "nothing"))  # the thread waiting for work took the unpatched method
    atomic.wait_for_cleanup()
    try:
        save_checkpoint(small_checkpoint(2), path, external_data="params")  # over a file: .ckpt and .data retired
        atomic.remove(str(other))
        hidden = sorted(n for n in os.listdir(tmp_path) if n.endswith(".old"))
        assert len(hidden) == 3, os.listdir(tmp_path)
        assert atomic.drain_deletions(timeout=0.05) is False
        assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".old")) == hidden
    finally:
        gate.set()
    assert atomic.drain_deletions() is True
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt", "model.ckpt.data"]
    assert_same_checkpoint(load_checkpoint(path), expected(2))


def test_drain_deletions_returns_once_the_unlink_thread_has_ended(tmp_path):
    """The thread clears its own slot before it returns: ``drain_deletions`` waits for that thread itself, so no
    thread of ours is alive when it returns (a test counting threads after a fit saw ``ort-ckpt-unlink`` once)."""
    for i in range(300):
        target = tmp_path / f"f{i}"
        target.write_bytes(b"x")
        atomic._UNLINKER.put(str(target))
        assert atomic.drain_deletions() is True
        assert [t.name for t in threading.enumerate() if t.name == "ort-ckpt-unlink"] == []
        assert not target.exists()
