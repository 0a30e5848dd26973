"""Frozen sharing without a single point of failure (issue 24), with real files on disk.

* every frozen byte is in two independent ``.data`` files: consecutive saves alternate between two copies, and no copy
  takes more than ``LINKS_PER_COPY`` saves;
* a flipped byte (mtime moved or restored), a truncated file, ``cp`` over one name and ORT's own
  ``CheckpointState.save_checkpoint`` over a shared path as root damage only that file: the checkpoints linking it
  still load, from the other copy (issue 32: tests/format/test_healing.py), the next save that would link it reads it
  back, warns, writes a fresh copy and repairs them, and damage that hides from the file's identity is found within
  ``VERIFY_EVERY`` saves;
* where ``link()`` is refused (EPERM, EXDEV) or the store has no hard links, every save is whole and loads;
* ``fit(ckpt_path="last")`` resumes from the newest checkpoint, and ``ort-ckpt verify`` (which reads a file as ORT
  does, without the other copy) names every checkpoint sharing a damaged ``.data``;
* retention that deletes every checkpoint of one copy (a metric-ranked top-k) leaves that copy under a hidden,
  read-only reserve name while kept checkpoints link the other, and drops it once two copies are named by checkpoints
  again: among the files on disk every frozen byte stays in two inodes after every save, sync and async.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_ort_ckpt._command import _cli
from lightning_ort_ckpt import _sharing as sharing
from lightning_ort_ckpt._sharing import _limits as limits
from lightning_ort_ckpt.errors import CheckpointError, CheckpointWarning
from lightning_ort_ckpt.format import CheckpointContents, CheckpointReader, load_checkpoint, save_checkpoint
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt.format import _shared_data as shared
from lightning_ort_ckpt.format._local_store import LocalStore
from helpers.ort_reference import ort_api
from helpers.frozen import ENTRY, SHARED, checkpoints, fit, inode, second_copy_at_once  # noqa: F401 (autouse)
from helpers.frozen import StartStep, flip, frozen_module, record_read_backs

WEIGHT = "weight"  # 2 MiB of frozen float32: shared
WINDOW = limits.ONE_COPY_SAVES  # the default (the fixture second_copy_at_once sets none)


def save(sh: sharing.FrozenSharing, module: torch.nn.Module, path: Path, tag: str) -> None:
    """One sharing save of the module's frozen state, as the plugin makes it."""
    ck = CheckpointContents(frozen=dict(module.state_dict()), properties={"tag": tag})
    snap = sh.snapshot(ck, str(path), module)
    assert snap is not None
    sh.save(ck, str(path), snap, "auto")


def data(path: Path) -> Path:
    return Path(atomic.data_path(str(path)))


def loads(path: Path, module: torch.nn.Module, heal: bool = True) -> bool:
    """Whether ``path`` loads with the module's frozen values (``heal=False``: from its own files alone, as ORT
    reads it; else a damaged frozen tensor is read from the other copy, issue 32)."""
    try:
        with CheckpointReader(path, heal=heal) as reader:
            ck = reader.load()
    except CheckpointError:
        return False
    assert torch.equal(ck.frozen[WEIGHT], module.weight)
    return True


def heals(path: Path, module: torch.nn.Module) -> bool:
    """Whether ``path`` is damaged in its own files, yet loads whole from the other copy, with a warning."""
    with pytest.warns(CheckpointWarning, match="read from the other copy"):
        healed = loads(path, module)
    return healed and not loads(path, module, heal=False)


_MADE: list[sharing.FrozenSharing] = []  # by run(): closed when the test ends (_closed)


@pytest.fixture(autouse=True)
def _closed() -> Iterator[None]:
    """Every ``FrozenSharing`` that :func:`run` made is closed when the test ends, as a plugin's teardown closes its
    own: its worker thread never outlives the test (closing twice is harmless)."""
    yield
    while _MADE:
        _MADE.pop().close()


def run(tmp_path: Path, n: int, sh: sharing.FrozenSharing | None = None,
        module: torch.nn.Module | None = None) -> tuple[sharing.FrozenSharing, torch.nn.Module, list[Path]]:
    if sh is None:
        sh = sharing.FrozenSharing()
        _MADE.append(sh)
    module = module or frozen_module()
    paths = [tmp_path / f"step={i}.ckpt" for i in range(1, n + 1)]
    for i, p in enumerate(paths, 1):
        save(sh, module, p, f"step {i}")
    atomic.wait_for_cleanup()
    return sh, module, paths


def hidden(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def held(sh: sharing.FrozenSharing) -> threading.Event:
    """Keep the background worker of ``sh`` busy until the event is set: what it is asked meanwhile waits."""
    gate = threading.Event()
    sh._worker.submit(gate.wait, 60)
    return gate


# -- 1. two independent copies ------------------------------------------------------------------------------------
def test_consecutive_saves_alternate_between_two_independent_copies(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "LINKS_PER_COPY", 3)
    _, module, paths = run(tmp_path, 12)
    inodes = [inode(p) for p in paths]
    assert all(a != b for a, b in zip(inodes, inodes[1:]))  # any two consecutive files: two independent copies
    for ino in set(inodes):
        assert inodes.count(ino) <= 1 + 3  # written once, linked at most LINKS_PER_COPY times
    assert len(set(inodes)) >= 4  # so copies were renewed
    for p in paths:
        assert loads(p, module)
        assert not data(p).stat().st_mode & 0o222


def test_the_second_copy_is_written_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The saves right after the first link the one copy while the second is written in the background (they do
    not wait for it: here it cannot even start); the next save waits for it, links it, and from then on saves
    alternate. Nothing hidden is left but what a checkpoint links; close() stops the thread."""
    monkeypatch.setattr(limits, "ONE_COPY_SAVES", WINDOW)  # the default, undoing the fixture's
    window = WINDOW
    assert window >= 1
    sh, module = sharing.FrozenSharing(), frozen_module()
    gate = held(sh)
    paths = [tmp_path / f"step={i}.ckpt" for i in range(1, window + 8)]
    for i, p in enumerate(paths[:window + 1], 1):
        save(sh, module, p, f"step {i}")
    spare = sh._dirs[str(tmp_path)].spare
    assert not spare.job.done() and not os.path.exists(spare.tmp)  # the window's saves did not wait for it
    assert len({inode(p) for p in paths[:window + 1]}) == 1  # the window: one copy
    gate.set()
    for i, p in enumerate(paths[window + 1:], window + 2):
        save(sh, module, p, f"step {i}")
    inodes = [inode(p) for p in paths]
    assert inodes[window + 1] != inodes[0]
    assert all(a != b for a, b in zip(inodes[window:], inodes[window + 1:]))  # then alternating
    assert len(set(inodes)) == 2 and hidden(tmp_path) == []  # the second copy's hidden name went when it was linked
    sh.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("ort-ckpt-frozen-copies")]
    for p in paths:
        assert loads(p, module)


def test_a_copy_written_from_damaged_bytes_is_never_linked(tmp_path: Path) -> None:
    """The background copy reads the first copy, which a flip damaged before it could (same size and mtime): the
    copy is read back against the checksums, fails, and the save that would link it warns and writes a fresh one."""
    sh, module = sharing.FrozenSharing(), frozen_module()
    gate = held(sh)
    first = tmp_path / "step=1.ckpt"
    save(sh, module, first, "step 1")
    flip(data(first), keep_mtime=True)
    gate.set()
    second = tmp_path / "step=2.ckpt"
    with pytest.warns(CheckpointWarning, match=r"shared \.data is damaged .*step=1\.ckpt"):
        save(sh, module, second, "step 2")
    assert inode(second) != inode(first) and loads(second, module)
    for i in range(3, 6):  # and nothing links the damaged one later
        save(sh, module, tmp_path / f"step={i}.ckpt", f"step {i}")
        assert inode(tmp_path / f"step={i}.ckpt") != inode(first) and loads(tmp_path / f"step={i}.ckpt", module)
    sh.close()
    assert hidden(tmp_path) == []


def test_teardown_stops_the_background_thread_and_leaves_nothing_hidden(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fit with a window of one save: the plugin's teardown waits for the background work and stops its thread;
    what is left in the folder is the checkpoints and their .data files."""
    monkeypatch.setattr(limits, "ONE_COPY_SAVES", 1)
    fit(tmp_path / "run", steps=6)
    assert not [t for t in threading.enumerate() if t.name.startswith("ort-ckpt-frozen-copies")]
    files = checkpoints(tmp_path / "run")
    assert len(files) == 6 and hidden(tmp_path / "run") == []
    inodes = [inode(p) for p in files]
    assert inodes[0] == inodes[1] and len(set(inodes)) == 2  # the second save in the window, then alternating
    assert all(a != b for a, b in zip(inodes[1:], inodes[2:]))


@pytest.mark.parametrize("sendfile", [True, False], ids=["sendfile", "refused"])
def test_write_copy_makes_an_independent_durable_read_only_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                sendfile: bool) -> None:
    """The copy is a new inode with the same bytes (through a buffer where the kernel refuses sendfile), read back
    against the checksums; a source that is no longer the inode asked for, or whose bytes differ, leaves nothing."""
    sh, module, paths = run(tmp_path, 1)
    sh.close()
    copy = sh._dirs[str(tmp_path)].copies[0]
    source = str(data(paths[0]))
    if not sendfile:
        def refuse(*args: Any) -> int:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

        monkeypatch.setattr(os, "sendfile", refuse)
    expected = shared.identity(os.stat(source))
    tmp = str(tmp_path / ".copy.tmp")
    assert shared.write_copy(source, expected, tmp, copy.offsets, copy.layout, copy.digests) == (True, [])
    st = os.stat(tmp)
    assert st.st_ino != expected[1] and st.st_nlink == 1 and not st.st_mode & 0o222
    assert Path(tmp).read_bytes() == data(paths[0]).read_bytes()
    os.unlink(tmp)
    stale = (*expected[:3], expected[3] + 1)
    assert shared.write_copy(source, stale, tmp, copy.offsets, copy.layout, copy.digests) == (False, [])
    flip(data(paths[0]), keep_mtime=True)
    assert shared.write_copy(source, expected, tmp, copy.offsets, copy.layout, copy.digests) == (False, [WEIGHT])
    assert hidden(tmp_path) == []


def on_worker(calls: list[tuple[str, str]]) -> bool:
    return all(t.startswith("ort-ckpt-frozen-copies") for t, _ in calls)


def test_read_backs_run_in_the_background_even_where_retention_deletes_the_name_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every VERIFY_EVERY saves each copy is read back, on the worker thread, started ahead: the save that relies on
    it takes its result (waiting where it is not done), also where retention (a top-2 deleting the oldest) deleted
    names of the copy before the worker got to them; no save reads a copy back itself. The worker is held until
    each deletion is done, so every read-back starts after it."""
    monkeypatch.setattr(limits, "VERIFY_EVERY", 8)
    calls = record_read_backs(monkeypatch)
    sh, module = sharing.FrozenSharing(), frozen_module()
    paths = [tmp_path / f"step={i}.ckpt" for i in range(1, 25)]
    for i, p in enumerate(paths):
        gate = held(sh)  # behind what earlier saves asked for: a save that waits for that never waits for the gate
        save(sh, module, p, f"step {i + 1}")
        if i >= 2:
            sh.before_remove(str(paths[i - 2]))
            atomic.remove(str(paths[i - 2]))
            atomic.wait_for_cleanup()
        gate.set()
    sh.close()
    assert len(calls) >= 4 and on_worker(calls), calls
    assert all(c.verified >= 24 - 8 for c in sh._dirs[str(tmp_path)].copies)  # and their results were taken
    for p in paths[-2:]:
        assert loads(p, module)


def test_a_read_back_whose_first_name_was_deleted_reads_another_name_of_the_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention deletes the very name a background read-back was to read, before the worker gets to it: the
    read-back reads another name of the same file, and the save that relies on it takes that result."""
    monkeypatch.setattr(limits, "VERIFY_EVERY", 8)
    calls = record_read_backs(monkeypatch)
    sh, module, paths = run(tmp_path, 6)
    gate = held(sh)
    seventh = tmp_path / "step=7.ckpt"
    save(sh, module, seventh, "step 7")  # 3/4 of VERIFY_EVERY after the first: both read-backs are asked for
    copies = sh._dirs[str(tmp_path)].copies
    first = [c.checking[1] for c in copies if c.checking is not None]
    assert len(first) == 2 and calls == []
    for name in first:
        checkpoint = name[:-len(".data")]
        sh.before_remove(checkpoint)
        atomic.remove(checkpoint)
    atomic.wait_for_cleanup()
    gate.set()
    later = [tmp_path / f"step={i}.ckpt" for i in range(8, 11)]
    for i, p in enumerate(later, 8):
        save(sh, module, p, f"step {i}")
    sh.close()
    read, gone = [n for _, n in calls], {os.path.basename(n) for n in first}
    others = [n for n in read if n not in gone]
    assert on_worker(calls) and gone <= set(read) and len(others) == 2, calls  # each tried, then another name
    assert all((tmp_path / n).exists() for n in others)
    assert all(c.verified >= 7 for c in sh._dirs[str(tmp_path)].copies)
    for p in [q for q in paths + [seventh] + later if q.exists()]:
        assert loads(p, module)


def test_a_deletion_still_under_way_is_not_taken_for_an_outside_change(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention renames a checkpoint's .data away at once and unlinks it later: meanwhile the other names of that
    file show a new change time with the same link count, which is our deletion (announced to before_remove), not
    damage: the next save links the copy without reading it back."""
    sh, module, paths = run(tmp_path, 4)  # copy A: 1 and 3, copy B: 2 and 4
    calls = record_read_backs(monkeypatch)
    queued: list[str] = []
    monkeypatch.setattr(atomic._UNLINKER, "put", queued.append)  # the unlink waits
    before = os.stat(data(paths[2]))
    sh.before_remove(str(paths[0]))
    atomic.remove(str(paths[0]))
    trash = next(t for t in queued if os.stat(t).st_ino == before.st_ino)  # the .data (the .ckpt is the other)
    while os.stat(data(paths[2])).st_ctime_ns == before.st_ctime_ns:  # the clock ticked: another rename
        os.replace(trash, trash + "-")
        trash += "-"
    assert os.stat(data(paths[2])).st_nlink == before.st_nlink
    fifth = tmp_path / "step=5.ckpt"
    save(sh, module, fifth, "step 5")
    for t in [trash, *queued]:  # the deletions end
        if os.path.lexists(t):
            os.unlink(t)
    assert inode(fifth) == inode(paths[2]) and calls == []
    assert loads(fifth, module)


# -- 2. damage is found before anything links to it, and costs only its links --------------------------------------
@pytest.mark.parametrize("keep_mtime", [False, True], ids=["mtime-moved", "mtime-restored"])
def test_a_flipped_byte_costs_only_the_checkpoints_linking_that_file(tmp_path: Path, keep_mtime: bool) -> None:
    sh, module, paths = run(tmp_path, 4)  # 1 and 3 share copy A, 2 and 4 copy B
    assert inode(paths[0]) == inode(paths[2]) != inode(paths[1]) == inode(paths[3])
    flip(data(paths[2]), keep_mtime)
    assert heals(paths[0], module) and heals(paths[2], module)  # issue 32: read from the other copy
    assert loads(paths[1], module, heal=False) and loads(paths[3], module, heal=False)  # the other copy: whole
    with pytest.warns(CheckpointWarning, match=r"shared \.data is damaged .*2 checkpoint\(s\) linking to it were "
                                               r"repaired .*: step=1\.ckpt, step=3\.ckpt"):
        save(sh, module, tmp_path / "step=5.ckpt", "step 5")  # would link A: reads it back first, repairs it
    assert loads(paths[0], module, heal=False) and loads(paths[2], module, heal=False)  # whole again
    assert inode(paths[0]) == inode(paths[2]) not in (inode(paths[1]),)  # a fresh copy of their own
    fifth = tmp_path / "step=5.ckpt"
    assert inode(fifth) not in (inode(paths[0]), inode(paths[1]))  # a fresh copy
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing links A again, nothing warns again
        for i in range(6, 10):
            save(sh, module, tmp_path / f"step={i}.ckpt", f"step {i}")
    for i in range(4, 10):
        assert loads(tmp_path / f"step={i}.ckpt", module)
        assert inode(tmp_path / f"step={i}.ckpt") != inode(paths[0])


def test_damage_hidden_from_the_identity_is_found_within_verify_every_saves(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Same size and mtime, and a link count changed at the same time (which looks like our own link or deletion):
    no stat tells; the full read-back every VERIFY_EVERY saves does."""
    monkeypatch.setattr(limits, "VERIFY_EVERY", 6)
    sh, module, paths = run(tmp_path, 4)
    flip(data(paths[2]), keep_mtime=True)
    os.link(data(paths[2]), tmp_path / "extra-name")  # the link count moves with the change time
    found = None
    for i in range(5, 12):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            save(sh, module, tmp_path / f"step={i}.ckpt", f"step {i}")
        if any(issubclass(w.category, CheckpointWarning) and "damaged" in str(w.message) for w in caught):
            found = found or i
    assert found is not None and found - 4 <= 6  # found within VERIFY_EVERY saves of the damage
    for i in range(found, 12):  # from then on every save holds good bytes
        assert loads(tmp_path / f"step={i}.ckpt", module)
    assert loads(paths[1], module) and loads(paths[3], module)


@pytest.mark.parametrize("how", ["truncate", "cp"])
def test_truncate_or_cp_over_one_name(tmp_path: Path, how: str) -> None:
    sh, module, paths = run(tmp_path, 4)
    victim = data(paths[2])
    if how == "truncate":
        os.truncate(victim, victim.stat().st_size // 2)
    else:  # cp writes into the existing inode: every name of it sees the other bytes
        other = tmp_path / "other.bin"
        other.write_bytes(os.urandom(victim.stat().st_size))
        os.chmod(victim, 0o644)
        shutil.copyfile(other, victim)
    assert inode(paths[0]) == inode(paths[2])  # still one inode: both damaged
    assert heals(paths[0], module) and heals(paths[2], module)
    with pytest.warns(CheckpointWarning, match="damaged"):
        save(sh, module, tmp_path / "step=5.ckpt", "step 5")
    for p in (*paths, tmp_path / "step=5.ckpt"):
        assert loads(p, module, heal=False)  # repaired by the save that found it


def test_ort_saving_over_a_shared_path_as_root_costs_only_that_copy(tmp_path: Path) -> None:
    """Root ignores the mode: ORT rewrites the shared inode in its own layout. The other copy's checkpoints load,
    the next save does not link the damaged file, and ``ort-ckpt verify`` names every checkpoint it took."""
    assert os.geteuid() == 0, "the tests run as root: this is the case the mode cannot protect"
    api = ort_api()
    sh, module, paths = run(tmp_path, 4)
    stranger = tmp_path / "stranger" / "s.ckpt"
    stranger.parent.mkdir()
    save_checkpoint(CheckpointContents(frozen=dict(frozen_module(7).state_dict())), stranger, external_data="params")
    state = api.CheckpointState.load_checkpoint(str(stranger))
    api.CheckpointState.save_checkpoint(state, str(paths[2]))
    assert inode(paths[0]) == inode(paths[2])  # ORT wrote in place, through the shared inode
    assert heals(paths[0], module)
    assert loads(paths[1], module) and loads(paths[3], module)
    with pytest.raises(CheckpointError) as caught:
        CheckpointReader(paths[0], heal=False).load()
    note = shared.damage_note(str(paths[0]), str(caught.value))
    assert "shared .data" in note and "the 2 checkpoints" in note and "step=1.ckpt, step=3.ckpt" in note
    with pytest.warns(CheckpointWarning, match="damaged"):
        save(sh, module, tmp_path / "step=5.ckpt", "step 5")
    assert loads(tmp_path / "step=5.ckpt", module) and loads(paths[0], module, heal=False)


def test_verify_names_every_checkpoint_a_damaged_shared_data_takes(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _, module, paths = run(tmp_path, 5)  # copy A: 1, 3, 5
    flip(data(paths[0]), keep_mtime=False)
    assert _cli.main(["verify", str(paths[4])]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"INVALID {paths[4]}")
    assert f"{data(paths[4])} is a shared .data (hard links): the 3 checkpoints sharing it are damaged with it: " \
           "step=1.ckpt, step=3.ckpt, step=5.ckpt" in err
    assert _cli.main(["verify", str(paths[3])]) == 0  # copy B
    assert "shared" not in capsys.readouterr().err
    # damage in the main file only takes that file: no note
    main = paths[2].read_bytes()
    paths[2].write_bytes(main[:len(main) // 2])
    assert _cli.main(["verify", str(paths[2])]) == 1
    assert "shared .data" not in capsys.readouterr().err


# -- 3. where no link can be made ---------------------------------------------------------------------------------
@pytest.mark.parametrize("errno_", [errno.EPERM, errno.EXDEV])
def test_link_refused_midway_writes_whole_files_and_earlier_ones_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      errno_: int) -> None:
    sh, module, paths = run(tmp_path, 3)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(os, "link", refuse)
    later = [tmp_path / f"late={i}.ckpt" for i in range(4)]
    for i, p in enumerate(later):
        save(sh, module, p, f"late {i}")
    atomic.wait_for_cleanup()
    assert len({inode(p) for p in later}) == 4 and all(data(p).stat().st_nlink == 1 for p in later)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left behind
    for p in paths + later:
        assert loads(p, module)


def test_a_store_without_hard_links_writes_every_save_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LocalStore, "links", False)
    _, _, states = fit(tmp_path, steps=3)
    files = checkpoints(tmp_path)
    assert len(files) == 3
    for p in files:
        assert not data(p).exists()  # one self-contained file each, as share_frozen=False writes
        step = int(p.name.split("step=")[1].split(".")[0])
        assert torch.equal(load_checkpoint(p).frozen["backbone.2.weight"], states.states[step]["backbone.2.weight"])


def test_a_clone_where_the_file_system_has_them_else_a_hard_link(tmp_path: Path) -> None:
    source = tmp_path / "a.data"
    source.write_bytes(os.urandom(1 << 16))
    expected = shared.identity(source.stat())
    assert shared.link_into(str(source), expected, str(tmp_path / "b.data"))
    b = (tmp_path / "b.data").stat()
    if b.st_ino == source.stat().st_ino:  # ext4, tmpfs: no clones (FICLONE fails), a hard link instead
        assert b.st_nlink == 2
    else:  # XFS, Btrfs: an inode of its own, the same bytes, read-only
        assert b.st_nlink == 1 and (tmp_path / "b.data").read_bytes() == source.read_bytes()
        assert not b.st_mode & 0o222
    assert sorted(os.listdir(tmp_path)) == ["a.data", "b.data"]
    assert not shared.link_into(str(source), (*expected[:3], expected[3] + 1), str(tmp_path / "c.data"))
    assert sorted(os.listdir(tmp_path)) == ["a.data", "b.data"]


# -- 4. resuming ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("victim", ["step=6", "last"])
def test_last_resumes_from_the_newest_checkpoint_that_loads(tmp_path: Path, victim: str) -> None:
    run_dir = tmp_path / "run"
    fit(run_dir, steps=6, save_last=True)
    files = checkpoints(run_dir)
    victim = next(p.name for p in files if f"{victim}.ckpt" in p.name)
    assert len({inode(p) for p in files}) == 2
    flip(data(run_dir / victim), keep_mtime=True)
    lost = shared.sharing_checkpoints(str(run_dir / victim))
    assert 1 <= len(lost) < len(files)
    with pytest.raises(CheckpointError) as caught:
        CheckpointReader(run_dir / victim, heal=False).load()
    if len(lost) > 1:
        assert f"the {len(lost)} checkpoints sharing it" in shared.damage_note(str(run_dir / victim), str(caught.value))
    start = StartStep()
    fit(run_dir, steps=8, ckpt_path="last", save_last=True, extra=(start,))
    assert start.step == 6  # not 0: the other copy holds step 6 whole


# -- 5. retention keeps a reserve of the last copy ----------------------------------------------------------------
class Ranked(type(ENTRY.build(0))):  # type: ignore[misc]
    """The zoo's frozen backbone, logging a score by step: ``best_first`` ranks step 1 above all, later steps above
    earlier ones (a top-2 keeps step 1 and the newest), else later steps rank higher (a top-1 keeps the newest)."""

    best_first = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        step = self.global_step + 1  # the step the save after this batch is named after
        self.log("score", 1000.0 if self.best_first and step == 1 else float(step))
        return loss


def ranked(best_first: bool) -> Ranked:
    model = ENTRY.build(0)
    model.__class__ = type("RankedNow", (Ranked,), {"best_first": best_first})
    return model


def reserve_names(directory: Path) -> list[Path]:
    return sorted(directory / n for n in os.listdir(directory) if shared.is_reserve(n))


class TwoCopies(pl.Callback):
    """After every save (checked before the next one, and once more at the end: ``check``): among the checkpoints
    and reserves on disk, the frozen weight exists in at least two inodes; a reserve holds exactly its bytes, is
    read-only, and exists only for a copy no checkpoint names, one at most."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.reserved: list[int] = []  # the save count at each check where a reserve was on disk
        self.checks = 0

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if trainer.global_step >= 3:  # the save of this step comes after this hook: two saves so far
            self.check(trainer, module, trainer.global_step - 1)

    def check(self, trainer: Any, module: Any, saves: int) -> None:
        trainer.strategy.checkpoint_io.wait()  # an asynchronous save and its deletions are done
        files, kept = checkpoints(self.directory), reserve_names(self.directory)
        named = {inode(p) for p in files}
        reserved = {r.stat().st_ino for r in kept}
        assert len(named | reserved) >= 2, (files, kept)
        assert not named & reserved and len(kept) <= 1  # a reserve only for a copy no checkpoint names
        weight = module.state_dict()[SHARED].detach().numpy().tobytes()
        for r in kept:
            assert r.read_bytes() == weight and not r.stat().st_mode & 0o222
        self.checks += 1
        if kept:
            self.reserved.append(saves)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_top1_keeps_the_last_copy_under_a_reserve_name(tmp_path: Path, async_save: bool) -> None:
    """A top-1 by a rising score deletes the previous checkpoint at every save, which always holds the other copy:
    its .data stays as the reserve, the next save links it (and drops that name), and so on."""
    run_dir = tmp_path / "run"
    checker = TwoCopies(run_dir)
    trainer, _, _ = fit(run_dir, steps=6, model=ranked(best_first=False), extra=(checker,), monitor="score",
                        mode="max", save_top_k=1, async_save=async_save)
    checker.check(trainer, trainer.lightning_module, 6)
    files = checkpoints(run_dir)
    assert len(files) == 1 and files[0].name.endswith("-step=6.ckpt")  # ranking deleted every other one
    assert checker.checks == 5 and checker.reserved == [2, 3, 4, 5, 6]  # after every save from the second on
    assert not [n for n in os.listdir(run_dir) if n.endswith((".tmp", ".old"))]  # no leftover besides
    # damage the reserve: the newest still loads and "last" resumes from it
    reserve, = reserve_names(run_dir)
    flip(reserve, keep_mtime=False)
    assert torch.equal(load_checkpoint(files[0]).frozen[SHARED], trainer.lightning_module.state_dict()[SHARED])
    start = StartStep()
    trainer, _, _ = fit(run_dir, steps=9, ckpt_path="last", model=ranked(best_first=False), extra=(start,),
                        monitor="score", mode="max", save_top_k=1, async_save=async_save)
    assert start.step == 6
    # the resumed run kept the earlier run's reserve (and the .data of step 6) until two copies of its own were on
    # disk, then went on as before: the damaged reserve is gone
    TwoCopies(run_dir).check(trainer, trainer.lightning_module, 9)
    assert [p.name.split("-")[-1] for p in checkpoints(run_dir)] == ["step=9.ckpt"]
    assert len(reserve_names(run_dir)) == 1  # holding the right bytes (checked above)


@pytest.mark.parametrize("victim", ["best", "newest"])
def test_top2_keeping_the_best_and_the_newest(tmp_path: Path, victim: str) -> None:
    """Step 1 ranks best, then later steps: the top 2 is step 1 (copy A) and the newest, which alternates between
    the copies. When the newest links A, no checkpoint names B: it is the reserve until the next save links it."""
    run_dir = tmp_path / "run"
    checker = TwoCopies(run_dir)
    trainer, _, _ = fit(run_dir, steps=6, model=ranked(best_first=True), extra=(checker,), monitor="score",
                        mode="max", save_top_k=2)
    checker.check(trainer, trainer.lightning_module, 6)
    assert checker.reserved == [3, 5]  # and gone again after saves 4 and 6, which link B
    best, newest = sorted(checkpoints(run_dir), key=lambda p: int(p.name.split("step=")[1].split(".")[0]))
    assert best.name.endswith("-step=1.ckpt") and newest.name.endswith("-step=6.ckpt")
    assert inode(best) != inode(newest) and reserve_names(run_dir) == []
    flip(data(best if victim == "best" else newest), keep_mtime=True)
    start = StartStep()
    fit(run_dir, steps=8, ckpt_path="last", model=ranked(best_first=True), extra=(start,), monitor="score",
        mode="max", save_top_k=2)
    assert start.step == 6  # the newest, either way: a damaged copy heals from the other one (issue 32)


def test_a_fresh_copy_makes_the_reserve_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-1 retention by hand, a fresh copy after 2 links: the reserve goes when a save links it, or when a save
    writes a fresh copy (two copies named by checkpoints again); retention then reserves the copy it deletes."""
    monkeypatch.setattr(limits, "LINKS_PER_COPY", 2)
    sh, module = sharing.FrozenSharing(), frozen_module()
    paths = [tmp_path / f"step={i}.ckpt" for i in range(1, 9)]
    linked_reserve: list[bool] = []
    for i, p in enumerate(paths):
        before = [r.stat().st_ino for r in reserve_names(tmp_path)]
        save(sh, module, p, f"step {i + 1}")
        assert reserve_names(tmp_path) == []  # never needed right after a save
        if before:
            linked_reserve.append(before == [inode(p)])
        if i:
            sh.before_remove(str(paths[i - 1]))
            atomic.remove(str(paths[i - 1]))
            atomic.wait_for_cleanup()
            kept = reserve_names(tmp_path)
            assert len(kept) == 1 and kept[0].stat().st_ino != inode(p) and loads(p, module)  # the other copy
            assert kept[0].read_bytes() == data(p).read_bytes()  # the same tensors at the same offsets
    # saves 3 and 4 link the reserved copy; 5 and 6 find no second copy linked fewer than twice: each links a fresh
    # one, written in the background meanwhile; 7 links the reserve again, 8 another fresh copy
    assert linked_reserve == [True, True, False, False, True, False]
    reserve, = reserve_names(tmp_path)
    assert not atomic._LEFTOVER.match(reserve.name) and not atomic._OLD_LEFTOVER.match(reserve.name)
    atomic._sweep_stale(str(tmp_path), relist=True)
    atomic.wait_for_cleanup()
    assert reserve.exists()  # not a leftover of a dead save
    assert all(not shared.is_reserve(p) for p in LocalStore().list_files(str(tmp_path), False))
    assert shared.sharing_checkpoints(str(paths[-1])) == [str(paths[-1])]
    sh.close()
    assert hidden(tmp_path) == [reserve.name]  # the copy written for a ninth save went with close()
