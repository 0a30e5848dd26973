"""Frozen-tensor sharing (``lightning_ort_ckpt._sharing``, ``format.shared``): saves write only what changed.

* saves whose frozen tensors did not change share ``.data`` inodes (hard links) and write only the main file,
  alternating between two independent copies (issue 24: tests/lightning_side/test_sharing_redundancy.py); every file
  still loads alone (in our reader and in ORT 1.19.2, which trains a step from it) and resumes bitwise;
* deleting, rotating or overwriting any checkpoint leaves the others whole, and a save killed at any point of a
  sharing save leaves every earlier file intact;
* a frozen tensor that changed (``load_state_dict``, a write through ``.data``), and BatchNorm statistics, are
  written fresh; async saves, ``save_last`` (copy and link), top-k and ``keep_newest`` all share; where no hard link
  can be made (another file system) each save writes a whole ``.data``, and ``share_frozen=False`` turns it off.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_ort_ckpt import OrtCheckpointIO
from lightning_ort_ckpt import _sharing as sharing
from lightning_ort_ckpt._sharing import _limits as limits
from lightning_ort_ckpt.format import CheckpointContents, load_checkpoint, open_checkpoint
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt.format import save_checkpoint
from lightning_ort_ckpt.format import _shared_data as shared
from lightning_ort_ckpt.format._shared_data import SharedFrozen
from lightning_ort_ckpt.format._store import store_for
from helpers import forkserver
from helpers.ort_reference import assert_same_checkpoint, assert_same_tensor, ort_api
from helpers.zoo_models import BATCH
from helpers.frozen import ENTRY, SHARED, Scored, checkpoints, fit, frozen_checkpoint, inode, linked_spec
from helpers.frozen import second_copy_at_once  # noqa: F401 (autouse)

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # helpers/ is in it


def external(path: Path) -> dict[str, int]:
    with open_checkpoint(path) as r:
        return {i.name: i.offset for i in r.tensors() if i.storage == "external"}


def assert_alone_holds(path: Path, state: dict[str, torch.Tensor], tmp: Path) -> None:
    """``path`` copied with its ``.data`` to a folder of its own loads (checksums verified) as ``state``."""
    alone = tmp / f"alone-{path.name}"
    alone.mkdir()
    shutil.copyfile(path, alone / path.name)
    shutil.copyfile(atomic.data_path(str(path)), alone / (path.name + ".data"))
    ck = load_checkpoint(alone / path.name)
    for name, t in state.items():
        if name in ck.trainable or name in ck.frozen:
            assert_same_tensor((ck.trainable.get(name, ck.frozen.get(name))), t, f"{path.name}: {name}")


# -- sharing happens, and every file stays whole -----------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("save_last", [True, "link"], ids=["last-copy", "last-link"])
def test_unchanged_saves_share_one_data_file(tmp_path: Path, async_save: bool, save_last: Any) -> None:
    _, cb, states = fit(tmp_path / "run", async_save=async_save, save_last=save_last)
    files = checkpoints(tmp_path / "run")
    last = tmp_path / "run" / "last.ckpt"
    assert len(files) == 7 and last in files
    assert os.path.islink(last) == (save_last == "link")
    frozen_bytes = ENTRY.build(0).state_dict()[SHARED].numel() * 4
    inodes = {inode(p) for p in files}
    assert len(inodes) == 2  # two independent .data files for all seven files (the redundancy of issue 24)
    datas = {inode(p): Path(atomic.data_path(str(p))) for p in files if not os.path.islink(p)}
    assert sum(d.stat().st_nlink for d in datas.values()) == 6 + (save_last is True)  # a symlink is no extra link
    for data in datas.values():
        assert data.stat().st_size == frozen_bytes and not data.stat().st_mode & 0o222  # read-only
    for p in files:
        assert external(p) == {SHARED: 0}
        assert p.stat().st_size < frozen_bytes / 8  # the main file holds only what is not shared
        step = int(p.name.split("step=")[1].split(".")[0]) if "step=" in p.name else 6
        assert_alone_holds(p, states.states[step], tmp_path)


def test_each_shared_file_trains_in_ort_alone_and_resumes_bitwise(tmp_path: Path) -> None:
    from lightning_ort_ckpt.artifacts import make_training_artifacts

    run = tmp_path / "run"
    trainer, _, _ = fit(run, steps=8)
    final = {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}
    files = checkpoints(run)
    assert len({inode(p) for p in files}) == 2
    art = make_training_artifacts(ENTRY.cls, files[0], tmp_path / "art")
    api = ort_api()
    x, y = ENTRY.data(seed=5)
    for p in files:
        alone = tmp_path / "ort" / p.name
        alone.parent.mkdir(exist_ok=True)
        shutil.copyfile(p, alone)
        shutil.copyfile(atomic.data_path(str(p)), str(alone) + ".data")
        state = api.CheckpointState.load_checkpoint(str(alone))
        ours = load_checkpoint(p)
        for name, param in state.parameters:
            if name in ours.frozen or name in ours.trainable:
                assert_same_tensor(torch.from_numpy(param.data.copy()),
                                   ours.frozen.get(name, ours.trainable.get(name)), name)
        module = api.Module(art.training_model, state, art.eval_model)
        optimizer = api.Optimizer(art.optimizer_model, module)
        module.train()
        before = state.parameters["head.weight"].data.copy()
        module(x[:BATCH].numpy(), y[:BATCH].numpy())
        optimizer.step()
        assert (state.parameters["head.weight"].data != before).any(), p.name
        assert (state.parameters[SHARED].data == ours.frozen[SHARED].numpy()).all()
    # the file of step 4 (an epoch boundary), a linked one, resumes to the uninterrupted run's step 8 bitwise
    resumed, _, _ = fit(tmp_path / "resumed", steps=8, ckpt_path=run / "epoch=0-step=4.ckpt")
    for k, v in final.items():
        assert_same_tensor(resumed.lightning_module.state_dict()[k], v, k)


def test_deleting_rotating_and_overwriting_others_never_damages_a_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _, _, states = fit(run, steps=5, save_last=True)
    files = checkpoints(run)
    expected = {p: load_checkpoint(p) for p in files}
    # overwrite one name (a save to an existing path), with sharing off and a changed backbone
    model = ENTRY.build(1)
    io = OrtCheckpointIO(share_frozen=False)
    fit(tmp_path / "other", steps=1, model=model, io=io)
    victim = run / "epoch=0-step=2.ckpt"
    shutil.copyfile(checkpoints(tmp_path / "other")[0], str(victim) + ".new")
    save_checkpoint(load_checkpoint(str(victim) + ".new"), victim)  # the ordinary commit renames over it
    os.unlink(str(victim) + ".new")
    atomic.wait_for_cleanup()
    expected.pop(victim)
    for p, ck in expected.items():
        assert_same_checkpoint(load_checkpoint(p), ck)
    # delete the others one by one, in an order that removes the first name of the inode first
    for gone in sorted(expected, key=lambda p: p.name):
        atomic.remove(str(gone))
        atomic.wait_for_cleanup()
        for p, ck in expected.items():
            if p.exists():
                assert_same_checkpoint(load_checkpoint(p), ck)
    assert checkpoints(run) == [victim]


@pytest.mark.parametrize("retention", ["top_k", "keep_newest"])
def test_rotation_keeps_one_frozen_copy(tmp_path: Path, retention: str) -> None:
    kw = {"monitor": "score", "mode": "max", "save_top_k": 3} if retention == "top_k" else {"keep_newest": 3}
    _, _, states = fit(tmp_path, steps=7, model=Scored(), save_last=True, **kw)
    files = checkpoints(tmp_path)
    assert len(files) == 4 and tmp_path / "last.ckpt" in files
    assert len({inode(p) for p in files}) == 2  # two independent copies (issue 24), no more
    datas = {inode(p): Path(atomic.data_path(str(p))) for p in files}
    assert sum(d.stat().st_nlink for d in datas.values()) == 4  # the rotated-out files' names are gone
    frozen_bytes = ENTRY.build(0).state_dict()[SHARED].numel() * 4
    used = sum(p.stat().st_size for p in files) + 2 * frozen_bytes
    assert used <= 2 * frozen_bytes + 4 * max(p.stat().st_size for p in files)
    for p in files:
        step = int(p.name.split("step=")[1].split(".")[0]) if "step=" in p.name else 7
        assert_alone_holds(p, states.states[step], tmp_path)


# -- what changed is written fresh -------------------------------------------------------------------------------------
class Mutate(pl.Callback):
    """Changes the frozen backbone after a given step, in the way the test names."""

    def __init__(self, how: str, step: int) -> None:
        self.how, self.step = how, step

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        weight = module.backbone[2].weight
        if self.how == "load_state_dict":
            state = module.state_dict()
            state[SHARED] = weight.detach() * 2
            module.load_state_dict(state)
        elif self.how == "data":
            # bypasses the version counter: an asynchronous save still being written would read it (docs/guide.md
            # says to wait for it first, as for any change that torch cannot see)
            trainer.strategy.checkpoint_io.wait()
            weight.data[0, 0] += 1.0
        elif self.how == "replace":
            module.backbone[2].weight = torch.nn.Parameter(weight.detach() + 1, requires_grad=False)


@pytest.mark.parametrize("how", ["load_state_dict", "data", "replace"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_changed_frozen_tensor_is_written_fresh(tmp_path: Path, how: str, async_save: bool) -> None:
    # the change happens in on_train_batch_end of step 3 (Lightning runs checkpoint callbacks last: the step-3 save
    # sees it), so steps 1-2 hold the old backbone and steps 3-6 the new one
    # a write through .data is invisible to torch: the default hashes the linked frozen parameters, and sees it
    io = OrtCheckpointIO(async_save=async_save)
    _, _, at = fit(tmp_path, steps=6, io=io, extra=(Mutate(how, 3),))
    files = {int(p.name.split("step=")[1].split(".")[0]): p for p in checkpoints(tmp_path)}
    before, after = {inode(files[s]) for s in (1, 2)}, {inode(files[s]) for s in (3, 4, 5, 6)}
    assert len(before) == 2 and len(after) == 2 and not before & after  # two copies of each (issue 24)
    for step, p in files.items():
        assert_alone_holds(p, at.states[step], tmp_path)
    assert not torch.equal(at.states[2][SHARED], at.states[3][SHARED])


def test_trusted_sharing_takes_torchs_word_and_misses_a_write_through_data(tmp_path: Path) -> None:
    """``share_frozen="trusted"`` does not hash frozen parameters: a write through ``.data`` (which torch does not
    count) goes unseen and the later files keep linking the old bytes; the documented price of that setting."""
    io = OrtCheckpointIO(share_frozen="trusted")
    _, _, at = fit(tmp_path, steps=4, io=io, extra=(Mutate("data", 3),))
    files = {int(p.name.split("step=")[1].split(".")[0]): p for p in checkpoints(tmp_path)}
    assert len({inode(p) for p in files.values()}) == 2  # all four link the two copies written at steps 1 and 2
    assert not torch.equal(at.states[2][SHARED], at.states[3][SHARED])  # although the live weight changed
    with open_checkpoint(files[4]) as reader:
        assert torch.equal(reader.get_tensor(SHARED), at.states[2][SHARED])  # the stale bytes, as documented


def test_batchnorm_statistics_are_written_each_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MIN_BYTES", 1024)  # the BatchNorm buffers (5 KiB each) take part too
    _, _, states = fit(tmp_path, steps=4)
    files = checkpoints(tmp_path)
    first = external(files[0])
    assert {"bn.running_mean", "bn.running_var", SHARED} <= first.keys()  # the first save knows no history
    stats = {"bn.running_mean", "bn.running_var"}
    second = external(files[1])  # it links the second copy (issue 24), a copy of the first written in the background
    assert second.keys() == first.keys() - stats  # they changed at every step: inline from then on
    for p in files[2:]:
        assert external(p) == second  # the same layout in both copies, at the same offsets
    # their version counter does not move (BatchNorm's kernels update them unseen): the checksums caught it, the
    # first linking save left them out of the link, and every save shares one of the first two .data files
    assert len({inode(p) for p in files}) == 2
    for p in files:
        step = int(p.name.split("step=")[1].split(".")[0])
        assert_alone_holds(p, states.states[step], tmp_path)


def test_ort_saving_over_a_shared_file_fails_instead_of_damaging_the_others() -> None:
    """ORT's CheckpointState.save_checkpoint rewrites <path>.data in place; a shared .data is read-only, so ORT's
    save there fails and the other checkpoints keep their bytes, while ORT saves to a new path as usual (root
    ignores the mode: the child drops to nobody, in a directory of its own that nobody can reach)."""
    api = ort_api()
    import encodings.raw_unicode_escape  # noqa: F401  (imported before dropping privileges: nobody cannot read them)
    import encodings.unicode_escape  # noqa: F401

    directory = Path(tempfile.mkdtemp(prefix="ort-ckpt-shared-"))
    try:
        os.chmod(directory, 0o777)
        a, b = directory / "a.ckpt", directory / "b.ckpt"
        first = save_checkpoint(frozen_checkpoint(1), a, shared=SharedFrozen({"backbone.0.weight": -1,
                                                                              "backbone.1.weight": -1}))
        save_checkpoint(frozen_checkpoint(2), b, shared=linked_spec(first, str(a) + ".data"))
        os.chmod(b, 0o666)
        data = (directory / "a.ckpt.data").read_bytes()
        state = api.CheckpointState.load_checkpoint(str(b))
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            outcome = []
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            for target in (directory / "new.ckpt", b):
                try:
                    api.CheckpointState.save_checkpoint(state, str(target))
                    outcome.append("saved")
                except Exception:  # noqa: BLE001 - ORT raises RuntimeError
                    outcome.append("refused")
            os.write(write, " ".join(outcome).encode())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as f:
            assert f.read() == b"saved refused"
        assert (directory / "a.ckpt.data").read_bytes() == data
        assert_same_checkpoint(load_checkpoint(a), load_checkpoint_expected(1))
    finally:
        shutil.rmtree(directory)


# -- where sharing cannot happen ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("errno_", [errno.EXDEV, errno.EPERM])
def test_no_hard_links_falls_back_to_whole_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  errno_: int) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno_, os.strerror(errno_))

    monkeypatch.setattr(os, "link", refuse)
    _, _, states = fit(tmp_path, steps=3, save_last=True)
    files = checkpoints(tmp_path)
    assert len({inode(p) for p in files}) == len(files) == 4
    for p in files:
        assert Path(atomic.data_path(str(p))).stat().st_nlink == 1
        step = int(p.name.split("step=")[1].split(".")[0]) if "step=" in p.name else 3
        assert_alone_holds(p, states.states[step], tmp_path)


def test_share_frozen_false_writes_whole_files(tmp_path: Path) -> None:
    fit(tmp_path / "on", steps=2)
    fit(tmp_path / "off", steps=2, io=OrtCheckpointIO(share_frozen=False))
    for p in checkpoints(tmp_path / "off"):
        assert not Path(atomic.data_path(str(p))).exists()  # one self-contained file, as before
    on, off = checkpoints(tmp_path / "on"), checkpoints(tmp_path / "off")
    assert [p.name for p in on] == [p.name for p in off]
    for a, b in zip(on, off):  # the same tensors (the metadata names the directories, which differ)
        x, y = load_checkpoint(a), load_checkpoint(b)
        for kind in ("trainable", "frozen"):
            assert getattr(x, kind).keys() == getattr(y, kind).keys()
            for name, t in getattr(y, kind).items():
                if not name.startswith("lightning:"):
                    assert_same_tensor(getattr(x, kind)[name], t, name)


def test_share_frozen_takes_true_false_or_trusted() -> None:
    for value in (True, False, "trusted"):
        assert OrtCheckpointIO(share_frozen=value).share_frozen == value
    with pytest.raises(ValueError, match="share_frozen"):
        OrtCheckpointIO(share_frozen="yes")  # type: ignore[arg-type]


def test_remote_paths_are_never_shared() -> None:
    model = ENTRY.build(0)
    state = model.state_dict()
    ck = CheckpointContents(frozen={k: v for k, v in state.items() if k.startswith("backbone")})
    assert not store_for("s3://bucket/run/a.ckpt").links  # the plugin asks for a snapshot only where it links
    assert store_for("/tmp/run/a.ckpt").links
    assert sharing.FrozenSharing().snapshot(ck, "/tmp/run/a.ckpt", model) is not None


# -- format level: bytes written, and kills ----------------------------------------------------------------------------


def written_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def test_a_linked_save_writes_only_the_main_file(tmp_path: Path) -> None:
    names = {"backbone.0.weight": -1, "backbone.1.weight": -1}
    a = tmp_path / "a.ckpt"
    first = save_checkpoint(frozen_checkpoint(1), a, shared=SharedFrozen(names))
    assert first is not None and not first.linked
    before = written_bytes()
    second = save_checkpoint(frozen_checkpoint(2), tmp_path / "b.ckpt", shared=linked_spec(first, str(a) + ".data"))
    wrote = written_bytes() - before
    assert second is not None and second.linked and second.offsets == first.offsets
    main = (tmp_path / "b.ckpt").stat().st_size
    assert main <= wrote <= main + 4096  # the main file and the journal, nothing of the 1.5 MiB backbone
    assert_same_checkpoint(load_checkpoint(tmp_path / "b.ckpt"), load_checkpoint_expected(2))
    # a frozen tensor whose bytes differ from the linked .data (no version counter here): nothing is committed,
    # and the save again with a fresh .data holds the new bytes
    changed, c = frozen_checkpoint(3, frozen_seed=7), tmp_path / "c.ckpt"
    with pytest.raises(shared.NotShared) as caught:
        save_checkpoint(changed, c, shared=linked_spec(first, str(a) + ".data"))
    assert sorted(caught.value.names) == ["backbone.0.weight", "backbone.1.weight"]
    atomic.wait_for_cleanup()
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "a.ckpt.data", "b.ckpt", "b.ckpt.data"]
    third = save_checkpoint(changed, c, shared=SharedFrozen.fresh(first.offsets))
    assert third is not None and not third.linked and third.identity[1] != first.identity[1]
    assert_same_checkpoint(load_checkpoint(c), load_checkpoint_expected(3, 7))
    assert_same_checkpoint(load_checkpoint(a), load_checkpoint_expected(1))


def test_a_data_file_that_is_not_the_recorded_one_is_never_linked(tmp_path: Path) -> None:
    """The link must reach the very file recorded (device, inode, size and modification time): a file rewritten in
    place, or a new one that got a freed inode number back, differs in one of them."""
    names = {"backbone.0.weight": -1, "backbone.1.weight": -1}
    a = tmp_path / "a.ckpt"
    first = save_checkpoint(frozen_checkpoint(1), a, shared=SharedFrozen(names))
    stat = os.stat(str(a) + ".data")
    os.utime(str(a) + ".data", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # as a write in place would
    with pytest.raises(shared.NotShared) as caught:
        save_checkpoint(frozen_checkpoint(2), tmp_path / "b.ckpt", shared=linked_spec(first, str(a) + ".data"))
    assert caught.value.names == []
    atomic.wait_for_cleanup()
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "a.ckpt.data"]  # nothing written, no link left


def load_checkpoint_expected(seed: int, frozen_seed: int = 0) -> CheckpointContents:
    """What ``frozen_checkpoint`` reads back as (the reader adds nothing; tensors come back as torch)."""
    return frozen_checkpoint(seed, frozen_seed)


def test_resaving_a_path_whose_data_is_the_shared_one(tmp_path: Path) -> None:
    """``last.ckpt`` saved as a copy each time: its new ``.data`` is the inode it already has (a no-op rename)."""
    names = {"backbone.0.weight": -1, "backbone.1.weight": -1}
    last = tmp_path / "last.ckpt"
    first = save_checkpoint(frozen_checkpoint(1), last, shared=SharedFrozen(names))
    again = save_checkpoint(frozen_checkpoint(2), last, shared=linked_spec(first, str(last) + ".data"))
    assert again is not None and again.linked
    atomic.wait_for_cleanup()
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "last.ckpt.data"]  # no temporary left behind
    assert_same_checkpoint(load_checkpoint(last), load_checkpoint_expected(2))


_KILL_DURING_SHARING_SAVE = """
import os, signal, sys, shutil
sys.path.insert(0, {tests!r})
from helpers.frozen import frozen_checkpoint, linked_spec
from lightning_ort_ckpt.format import save_checkpoint
from lightning_ort_ckpt.format._shared_data import SharedFrozen
from lightning_ort_ckpt.format._store import store_for
directory, point, target = sys.argv[1], sys.argv[2], sys.argv[3]
a, b = os.path.join(directory, "a.ckpt"), os.path.join(directory, "b.ckpt")
names = {{"backbone.0.weight": -1, "backbone.1.weight": -1}}
first = save_checkpoint(frozen_checkpoint(1), a, shared=SharedFrozen(names))
save_checkpoint(frozen_checkpoint(2), b, shared=linked_spec(first, a + ".data"))
for name in ("a.ckpt", "b.ckpt"):
    shutil.copyfile(os.path.join(directory, name), os.path.join(directory, name + ".ref"))
real = {{"link": os.link, "replace": os.replace, "fsync": os.fsync}}
stage, _, what = point.partition(":")

def kill():
    os.kill(os.getpid(), signal.SIGKILL)

def link(src, dst, **kw):
    real["link"](src, dst, **kw)
    if stage == "after-link" and dst.endswith(".tmp") and ".data." in dst:
        kill()

def replace(src, dst, *a, **kw):
    if stage == "before-replace" and dst.endswith(what):
        kill()
    real["replace"](src, dst, *a, **kw)
    if stage == "after-replace" and dst.endswith(what):
        kill()

def fsync(fd):
    if stage == "before-fsync":
        kill()
    real["fsync"](fd)

os.link, os.replace, os.fsync = link, replace, fsync
save_checkpoint(frozen_checkpoint(3), os.path.join(directory, target), shared=linked_spec(first, a + ".data"))
print("saved", flush=True)
"""

POINTS = ["after-link", "before-fsync", "before-replace:.commit", "after-replace:.commit",
          "after-replace:.ckpt.data", "after-replace:.ckpt"]


@pytest.mark.parametrize("target", ["c.ckpt", "b.ckpt"], ids=["new-path", "overwrite-linked"])
@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_any_point_of_a_sharing_save_leaves_earlier_files_intact(tmp_path: Path, point: str,
                                                                            target: str) -> None:
    code = _KILL_DURING_SHARING_SAVE.format(tests=TESTS_DIR)
    proc = forkserver.spawn(code=code, args=[str(tmp_path), point, target])  # torch and Lightning imported once
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, out + str(err)
    expected = {"a.ckpt": 1, "b.ckpt": 2, "c.ckpt": 3}
    # every file not being saved is intact, byte for byte, and loads; the one being saved is old or new, whole
    a_data = tmp_path / "a.ckpt.data"
    assert a_data.stat().st_size == 512 * 512 * 4 + 256 * 512 * 4
    assert (tmp_path / "a.ckpt").read_bytes() == (tmp_path / "a.ckpt.ref").read_bytes()
    assert_same_checkpoint(load_checkpoint(tmp_path / "a.ckpt"), load_checkpoint_expected(1))
    if target == "c.ckpt":
        assert (tmp_path / "b.ckpt").read_bytes() == (tmp_path / "b.ckpt.ref").read_bytes()
        assert_same_checkpoint(load_checkpoint(tmp_path / "b.ckpt"), load_checkpoint_expected(2))
    if (tmp_path / target).exists():
        seen = load_checkpoint(tmp_path / target)
        assert seen.properties["tag"] in ("checkpoint-2", "checkpoint-3")
    # the next writer completes or drops the dead save; the file is then whole and the shared inode unharmed
    atomic.repair(tmp_path / target)
    if (tmp_path / target).exists():
        tag = load_checkpoint(tmp_path / target).properties["tag"]
        assert_same_checkpoint(load_checkpoint(tmp_path / target), load_checkpoint_expected(int(tag[-1])))
    assert_same_checkpoint(load_checkpoint(tmp_path / "a.ckpt"), load_checkpoint_expected(1))
    assert os.stat(tmp_path / "a.ckpt.data").st_ino == os.stat(tmp_path / "b.ckpt.data").st_ino
