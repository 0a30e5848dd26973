"""Readers and writers at the same time: readers never change the directory, never see a mixed pair, and writers
racing on one path leak nothing.

* A planted ``<path>.commit`` naming files that are not our temporaries: opening, loading and ``ort-ckpt inspect``
  change nothing on disk, and a save renames nothing it names.
* Stress (bounded, a few seconds): a writer process alternates two known states of a checkpoint with external data
  (parameters in ``.data``, optimizer state inline) while reader threads load it over and over; every load must be
  entirely one state (``.ckpt`` and ``.data`` of the same save), and the writer must finish every save.
* Two writer processes saving the same path, with the ``flock`` lock and with the portable lock file: afterwards no
  temporary, retired (``.old``), journal or lock file is left, and the file is one whole state.

Nothing is mocked: real processes, real files, the library's real readers and writers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from helpers.crash import snapshot

from lightning_ort_ckpt import CheckpointError
from lightning_ort_ckpt.format import (CheckpointContents, OptimizerGroup, load_checkpoint, open_checkpoint, save_checkpoint)
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt.format._atomic import _lock, _names, _pairs
from lightning_ort_ckpt.format._platform import PORTABLE_IO_ENV

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
STRESS_SECONDS = 3.0


def state(seed: int) -> CheckpointContents:
    """A small encoder-decoder's parameters and AdamW state, every element equal to ``seed``: a load that mixes two
    saves shows as tensors (from ``.data``) that disagree with the momentums and properties (from the ``.ckpt``)."""
    shapes = {"encoder.weight": (128, 256), "encoder.bias": (128,), "decoder.weight": (256, 128),
              "decoder.bias": (256,), "embed.weight": (512, 64)}
    params = {n: torch.full(s, float(seed)) for n, s in shapes.items()}
    return CheckpointContents(
        trainable=params,
        frozen={"norm.running_mean": torch.full((128,), float(seed))},
        optimizer_groups={"group0": OptimizerGroup(step=seed, initial_learning_rate=0.001, states={
            n: {"momentum0": torch.full(t.shape, float(seed)), "momentum1": torch.full(t.shape, float(seed))}
            for n, t in params.items()})},
        properties={"seed": seed})


def seeds_in(ck: CheckpointContents) -> set[float]:
    """Every distinct value in the loaded checkpoint: one value for a whole state."""
    values = {float(ck.properties["seed"])}
    tensors = [*ck.trainable.values(), *ck.frozen.values()]
    for group in ck.optimizer_groups.values():
        values.add(float(group.step))
        for momentums in group.states.values():
            tensors += momentums.values()
    for t in tensors:
        values.update(torch.unique(t).tolist())
    return values


def leftovers(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory)
                  if n.endswith((".tmp", ".old", atomic.JOURNAL_SUFFIX)) or n == atomic.LOCK_NAME)


# -- planted journals -----------------------------------------------------------------------------------------------
PLANTED = {
    "other-file": {"checkpoint": "notes.txt", "data": "notes.txt"},
    "escape": {"checkpoint": "../outside.txt", "data": "../outside.txt"},
    "our-pattern-other-base": {"checkpoint": ".other.ckpt.0a1b2c3d-0a1b2c3d.1.0a1b2c3d.tmp",
                               "data": ".other.ckpt.data.0a1b2c3d-0a1b2c3d.1.0a1b2c3d.tmp"},
    "not-json": None,
}


@pytest.mark.parametrize("kind", list(PLANTED))
def test_planted_journal_changes_nothing(tmp_path: Path, kind: str) -> None:
    directory = tmp_path / "ckpts"
    path = directory / "model.ckpt"
    save_checkpoint(state(1), path, external_data="params")
    atomic.wait_for_cleanup()
    (directory / "notes.txt").write_text("the user's notes\n")
    (tmp_path / "outside.txt").write_text("outside\n")
    (directory / ".other.ckpt.0a1b2c3d-0a1b2c3d.1.0a1b2c3d.tmp").write_text("not a checkpoint\n")
    (directory / ".other.ckpt.data.0a1b2c3d-0a1b2c3d.1.0a1b2c3d.tmp").write_text("not data\n")
    journal = Path(str(path) + atomic.JOURNAL_SUFFIX)
    journal.write_bytes(b"{not json" if PLANTED[kind] is None else json.dumps(PLANTED[kind]).encode())
    before, outside = snapshot(directory), (tmp_path / "outside.txt").read_bytes()

    with open_checkpoint(path) as r:
        assert r.properties["seed"] == 1
    assert seeds_in(load_checkpoint(path)) == {1.0}
    cli = subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", "inspect", str(path)], capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert snapshot(directory) == before  # nothing renamed, nothing deleted, nothing written
    assert (tmp_path / "outside.txt").read_bytes() == outside

    # A writer ignores a journal that is not ours too: it replaces the checkpoint and renames nothing else.
    save_checkpoint(state(2), path, external_data="params")
    atomic.wait_for_cleanup()
    after = snapshot(directory)
    for name in ("notes.txt", ".other.ckpt.0a1b2c3d-0a1b2c3d.1.0a1b2c3d.tmp",
                 ".other.ckpt.data.0a1b2c3d-0a1b2c3d.1.0a1b2c3d.tmp"):
        assert after[name] == before[name], name
    assert (tmp_path / "outside.txt").read_bytes() == outside
    assert seeds_in(load_checkpoint(path)) == {2.0}


# -- a writer and readers ---------------------------------------------------------------------------------------------
_WRITER = f"""
import sys, time
sys.path[:0] = [{TESTS_DIR!r}, {os.path.dirname(TESTS_DIR)!r}]  # this module, and helpers/
from test_concurrency import state
from lightning_ort_ckpt.format import save_checkpoint
path, seeds, seconds = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], float(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()  # "go": every process is past its imports
until, count = time.time() + seconds, 0
while time.time() < until or count < 2 * len(seeds):
    save_checkpoint(state(seeds[count % len(seeds)]), path, external_data="params")
    count += 1
print(count, flush=True)
"""


def start_writers(path: Path, seeds: list[str], seconds: float,
                  env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Writer processes, each saving ``path`` over and over for ``seconds``, all started at once."""
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_WRITER), str(path), s, str(seconds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for s in seeds]
    for p in procs:
        line = p.stdout.readline()
        assert line == "ready\n", line + p.stderr.read()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


def finish(proc: subprocess.Popen) -> int:
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"the writer failed:\n{out}\n{err}"
    return int(out.strip().splitlines()[-1])


def test_readers_see_whole_states_while_a_writer_replaces_the_pair(tmp_path: Path) -> None:
    path = tmp_path / "model.ckpt"
    save_checkpoint(state(1), path, external_data="params")
    results: dict[str, int] = {"loads": 0, "opens": 0, "busy": 0}
    seen: set[float] = set()
    mixed: list[set[float]] = []
    stop = threading.Event()
    lock = threading.Lock()

    def full_loads() -> None:
        while not stop.is_set():
            try:
                values = seeds_in(load_checkpoint(path))
            except CheckpointError as e:  # allowed, if rare: a clear "kept changing" error, never a wrong load
                assert "kept changing" in str(e), e
                with lock:
                    results["busy"] += 1
                continue
            with lock:
                results["loads"] += 1
                seen.update(values)
                if len(values) != 1:
                    mixed.append(values)

    def lazy_reads() -> None:  # the mapped reader: properties from the .ckpt, one tensor from the .data
        while not stop.is_set():
            try:
                with open_checkpoint(path) as r:
                    values = {float(r.properties["seed"]), *torch.unique(r.get_tensor("encoder.weight")).tolist()}
            except CheckpointError as e:
                assert "kept changing" in str(e), e
                continue
            with lock:
                results["opens"] += 1
                if len(values) != 1:
                    mixed.append(values)

    threads = [threading.Thread(target=full_loads), threading.Thread(target=lazy_reads)]
    for t in threads:
        t.start()
    (writer,) = start_writers(path, ["1,2"], STRESS_SECONDS)
    try:
        saves = finish(writer)
    finally:
        stop.set()
        for t in threads:
            t.join()
    print(f"{saves} saves, {results}")
    assert mixed == [], f"{len(mixed)} loads mixed two saves: {mixed[:5]}"
    assert saves >= 4 and results["loads"] >= 10 and results["opens"] >= 10, (saves, results)
    assert seen == {1.0, 2.0}, seen  # the readers really raced the writer
    assert results["busy"] <= results["loads"] // 10, results
    atomic.wait_for_cleanup()
    assert leftovers(tmp_path) == [], os.listdir(tmp_path)


@pytest.mark.parametrize("lock", ["flock", "lock-file"])
def test_two_writers_on_one_path_leak_nothing(tmp_path: Path, lock: str) -> None:
    path = tmp_path / "model.ckpt"
    env = dict(os.environ)
    env.pop(PORTABLE_IO_ENV, None)
    if lock == "lock-file":
        env[PORTABLE_IO_ENV] = "1"
    writers = start_writers(path, ["1,2", "3,4"], STRESS_SECONDS / 2, env)
    saves = [finish(w) for w in writers]
    print(f"saves per writer: {saves}")
    assert min(saves) >= 4
    # Both processes have exited: whatever they retired was unlinked (at the latest by the exit-time drain).
    assert leftovers(tmp_path) == [], os.listdir(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt", "model.ckpt.data"]
    assert len(seeds_in(load_checkpoint(path))) == 1


# -- the portable lock file -------------------------------------------------------------------------------------------
def test_lock_file_of_a_dead_writer_is_taken_over_and_a_live_one_waited_for(tmp_path: Path, monkeypatch) -> None:
    """Portable I/O: no flock, the lock file. One left by a writer that died in an earlier boot of this host is taken
    over at once (without probing pids); one held by a live process is waited for, then reported."""
    monkeypatch.setenv(PORTABLE_IO_ENV, "1")
    path = tmp_path / "model.ckpt"
    lock = tmp_path / atomic.LOCK_NAME
    earlier_boot = "f" * 8 if atomic._BOOT != "f" * 8 else "e" * 8
    lock.write_text(f"{atomic._HOST}-{earlier_boot}.{os.getpid()}")  # a writer of this host, before a crash
    save_checkpoint(state(1), path, external_data="params")
    assert not lock.exists() and seeds_in(load_checkpoint(path)) == {1.0}

    lock.write_text(f"{atomic._HOST}-{atomic._BOOT}.{os.getppid()}")  # a live writer holds it
    monkeypatch.setattr(_lock, "LOCK_WAIT_S", 0.3)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(state(2), path, external_data="params")
    assert atomic.LOCK_NAME in str(info.value) and "delete it" in str(info.value), info.value
    atomic.wait_for_cleanup()
    assert leftovers(tmp_path) == [atomic.LOCK_NAME], os.listdir(tmp_path)  # the waiting save left nothing
    assert seeds_in(load_checkpoint(path)) == {1.0}
    lock.unlink()
    save_checkpoint(state(2), path, external_data="params")
    assert seeds_in(load_checkpoint(path)) == {2.0} and not lock.exists()


# -- links: a pending link commit, and a link whose target has a pending commit ---------------------------------------
def test_reader_of_a_link_mid_commit_reads_one_target_whole(tmp_path: Path, monkeypatch) -> None:
    """``last.ckpt`` -> A is being re-pointed at B and the writer died after ``last.ckpt.data`` moved to B's data:
    the reader follows the journal to B, whole, and changes nothing. A pending commit of the target itself (its
    writer died mid-commit) is reported, not read as a mix."""
    a, b, last = tmp_path / "a.ckpt", tmp_path / "b.ckpt", tmp_path / "last.ckpt"
    save_checkpoint(state(1), a, external_data="params")
    save_checkpoint(state(2), b, external_data="params")
    atomic.link(str(a), str(last))
    assert last.is_symlink() and seeds_in(load_checkpoint(last)) == {1.0}
    token = _names.token()  # what atomic.link(b, last) does, up to its second rename
    tmp_main, tmp_data = f".last.ckpt.{token}.tmp", f".last.ckpt.data.{token}.tmp"
    os.symlink("b.ckpt", tmp_path / tmp_main)
    os.symlink("b.ckpt.data", tmp_path / tmp_data)
    (tmp_path / "last.ckpt.commit").write_text(json.dumps({"checkpoint": tmp_main, "data": tmp_data}))
    os.replace(tmp_path / tmp_data, tmp_path / "last.ckpt.data")
    before = snapshot(tmp_path)
    assert seeds_in(load_checkpoint(last)) == {2.0}
    with open_checkpoint(last) as r:
        assert r.properties["seed"] == 2 and set(torch.unique(r.get_tensor("encoder.weight")).tolist()) == {2.0}
    assert snapshot(tmp_path) == before
    assert atomic.repair(last) and os.readlink(last) == "b.ckpt" and seeds_in(load_checkpoint(last)) == {2.0}

    # b.ckpt's own writer died after moving the new .data in: through the link, that is reported, after retries
    save_checkpoint(state(3), tmp_path / "b3.ckpt", external_data="params")
    token = _names.token()
    os.replace(tmp_path / "b3.ckpt", tmp_path / f".b.ckpt.{token}.tmp")
    os.replace(tmp_path / "b3.ckpt.data", tmp_path / "b.ckpt.data")
    (tmp_path / "b.ckpt.commit").write_text(json.dumps({"checkpoint": f".b.ckpt.{token}.tmp",
                                                        "data": f".b.ckpt.data.{token}.tmp"}))
    assert seeds_in(load_checkpoint(b)) == {3.0}  # read directly: the new pair
    monkeypatch.setattr(_pairs, "_OPEN_ATTEMPTS", 3)
    with pytest.raises(CheckpointError, match="kept changing"):
        load_checkpoint(last)
    assert atomic.repair(b) and seeds_in(load_checkpoint(last)) == {3.0}
