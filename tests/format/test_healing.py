"""Frozen sharing that heals itself (issue 32), with real files on disk and real training runs.

A fine-tuning run with a frozen backbone (two frozen weights large enough to share), ``keep_newest=3`` plus
``save_last``, keeps its frozen tensors in two independent ``.data`` files. For each kind of damage to one of them
(``truncate`` to 0, ``cp`` of another run's file over it and ORT's own ``save_checkpoint`` over a checkpoint path,
both as root, a flipped byte in either copy, flips in both copies at different tensors):

* every kept checkpoint loads with the exact values it saved, the damaged tensor read from the other copy (one
  warning naming the damaged file), and ``fit(ckpt_path="last")`` resumes from the newest;
* ``ort-ckpt verify`` (as ORT would read the files: no fallback) still calls the damaged ones invalid, and
  ``ort-ckpt verify --repair DIR`` writes a fresh copy from good bytes, relinks them, says so, and leaves two good
  copies that load without any fallback;

``fit(ckpt_path="last")`` resumes from the newest before any repair too; the same tensor damaged in both copies is
an error naming it; damage found by the background read-back is repaired by the save that takes the read-back; a
reader that heals goes with its last reference (no cycle keeps its mapping). A sharded folder has no second copy of
a shard: a damaged one is not healed, and "last" falls back to the folder before it.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_ort_ckpt._command import _cli
from lightning_ort_ckpt import _sharing as sharing
from lightning_ort_ckpt._sharing import _limits as limits
from lightning_ort_ckpt.errors import CheckpointError, CheckpointWarning, CorruptCheckpointError
from lightning_ort_ckpt.format import CheckpointContents, CheckpointReader, load_checkpoint, open_checkpoint
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt.format import _shared_data as shared
from helpers.ort_reference import assert_same_tensor, ort_api
from helpers.frozen import ENTRY, checkpoints, fit, inode, second_copy_at_once  # noqa: F401 (autouse)
from helpers.frozen import StartStep, flip, frozen_module, record_read_backs

FIRST, SECOND = "backbone.2.weight", "backbone.4.weight"  # the two shared frozen tensors


class TwoFrozen(type(ENTRY.build(0))):  # type: ignore[misc]
    """The zoo's frozen backbone with a second large frozen layer: two tensors in the shared ``.data``."""

    def __init__(self, width: int = 512) -> None:
        super().__init__(width=width)
        self.backbone = nn.Sequential(nn.Linear(6, 256), nn.ReLU(), nn.Linear(256, 512), nn.ReLU(),
                                      nn.Linear(512, 512)).requires_grad_(False)


def train(directory: Path, seed: int = 0, **kw: Any) -> dict[int, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    _, _, states = fit(directory, steps=6, model=TwoFrozen(), keep_newest=3, save_last=True, **kw)
    return states.states


def step_of(path: Path) -> int:
    return int(path.name.split("step=")[1].split(".")[0]) if "step=" in path.name else 6


def data(path: Path) -> Path:
    return Path(atomic.data_path(str(path)))


def assert_exact(path: Path, state: dict[str, torch.Tensor], heal: bool = True) -> None:
    """``path`` loads (with or without the other copy) with exactly the values of ``state``."""
    with CheckpointReader(path, heal=heal) as reader:
        ck = reader.load()
    for name, t in state.items():
        if name in ck.trainable or name in ck.frozen:
            assert_same_tensor(ck.trainable.get(name, ck.frozen.get(name)), t, f"{path.name}: {name}")


def flip_in(path: Path, tensor: str) -> None:
    """Flip one byte in the middle of ``tensor``'s bytes in ``path``'s ``.data`` (every name of the inode)."""
    with open_checkpoint(path) as r:
        info = r.frozen[tensor]
    target = data(path)
    os.chmod(target, 0o644)
    with open(target, "r+b") as f:
        f.seek(info.offset + info.nbytes // 2)
        byte = f.read(1)
        f.seek(info.offset + info.nbytes // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    os.chmod(target, 0o444)


def copies(run: Path) -> dict[int, list[Path]]:
    """The checkpoints of ``run`` by the inode of their ``.data``."""
    found: dict[int, list[Path]] = {}
    for p in checkpoints(run):
        found.setdefault(inode(p), []).append(p)
    return found


def two_copies(run: Path) -> tuple[Path, Path]:
    """A checkpoint of each of the two copies: the newest, and the newest of the other copy."""
    files = sorted(checkpoints(run), key=lambda p: (step_of(p), p.name == "last.ckpt"))
    newest = files[-1]
    other = next(p for p in reversed(files) if inode(p) != inode(newest))
    return newest, other


def ort_saves_over(path: Path, source: Path) -> None:
    """ORT's own ``CheckpointState.save_checkpoint`` of ``source``'s state to ``path``, as root: it writes the main
    file and the (shared, read-only) ``.data`` in place."""
    api = ort_api()
    state = api.CheckpointState.load_checkpoint(str(source))
    api.CheckpointState.save_checkpoint(state, str(path))


DAMAGE = ["truncate", "cp", "ort_save", "flip_a", "flip_b", "flip_both"]


def damage_one(run: Path, tmp_path: Path, damage: str) -> tuple[list[Path], Path | None]:
    """Damage ``run``'s copies as ``damage`` says (see the module doc; ``flip_a``: a byte of the newest checkpoint's
    copy, ``flip_b``: of the other copy): the checkpoints whose ``.data`` it damaged, and the one ORT wrote over
    (``ort_save``; None otherwise)."""
    files = checkpoints(run)
    newest, other = two_copies(run)
    victims = [p for p in files if inode(p) == inode(newest)]
    overwritten: Path | None = None
    if damage == "truncate":
        os.truncate(data(newest), 0)
    elif damage in ("cp", "ort_save"):
        stranger = tmp_path / "stranger"
        train(stranger, seed=1)
        theirs = next(p for p in checkpoints(stranger) if step_of(p) == 6 and p.name != "last.ckpt")
        if damage == "cp":  # cp opens the read-only file for writing: root is not stopped
            shutil.copyfile(data(theirs), data(newest))
        else:  # ORT rewrites an older checkpoint of the newest copy, main file and shared .data, in place
            victims = max(copies(run).values(), key=len)  # a copy that two checkpoints link
            overwritten = min(victims, key=step_of)
            before = inode(overwritten)
            ort_saves_over(overwritten, theirs)
            assert inode(overwritten) == before and len(victims) > 1
    elif damage == "flip_a":
        flip_in(newest, SECOND)
    elif damage == "flip_b":
        flip_in(other, FIRST)
        victims = [p for p in files if inode(p) == inode(other)]
    else:
        flip_in(newest, SECOND)
        flip_in(other, FIRST)
        victims = files
    return victims, overwritten


@pytest.mark.parametrize("damage", DAMAGE)
def test_every_checkpoint_loads_exactly_resumes_and_is_repaired(tmp_path: Path, damage: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert os.geteuid() == 0, "the tests run as root: the case the read-only mode cannot protect"
    run = tmp_path / "run"
    states = train(run)
    files = checkpoints(run)
    assert len(files) == 4 and len(copies(run)) == 2  # steps 4, 5, 6 and last; two independent copies
    victims, overwritten = damage_one(run, tmp_path, damage)
    kept = [p for p in files if p != overwritten]
    for p in victims:
        if p == overwritten:
            continue
        with pytest.raises(CorruptCheckpointError):  # as ORT reads it: the file alone is damaged
            CheckpointReader(p, heal=False).load()
    for p in kept:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert_exact(p, states[step_of(p)])
        heals = [w for w in caught if issubclass(w.category, CheckpointWarning)]
        assert len(heals) == (1 if p in victims else 0), [str(w.message) for w in heals]  # once per load
        if heals:
            assert str(data(p)) in str(heals[0].message) and "read from the other copy" in str(heals[0].message)

    hit = next(p for p in victims if p != overwritten)
    assert _cli.main(["verify", str(hit)]) == 1  # verify reads as ORT does: invalid until repaired
    assert capsys.readouterr().err.startswith(f"INVALID {hit}")
    assert _cli.main(["verify", "--repair", str(run)]) == 0
    out = capsys.readouterr().out
    assert "REPAIRED" in out and "NOT REPAIRED" not in out
    for p in kept:
        assert_exact(p, states[step_of(p)], heal=False)  # whole again, without any fallback
    good = {inode(p) for p in kept}
    assert len(good) == 2  # two good copies (the file ORT wrote, no longer a kept checkpoint's, keeps its own)
    for p in kept:
        assert shared.recorded_slots(str(p)).keys() == {FIRST, SECOND}

    start = StartStep()
    fit(run, steps=7, model=TwoFrozen(), ckpt_path="last", keep_newest=3, save_last=True, extra=(start,))
    assert start.step == 6  # the newest


@pytest.mark.parametrize("damage", DAMAGE)
def test_last_resumes_from_the_newest_before_any_repair(tmp_path: Path, damage: str) -> None:
    run = tmp_path / "run"
    train(run)
    damage_one(run, tmp_path, damage)
    start = StartStep()
    fit(run, steps=7, model=TwoFrozen(), ckpt_path="last", keep_newest=3, save_last=True, extra=(start,))
    assert start.step == 6  # not an older one, not 0


def test_the_same_tensor_damaged_in_both_copies_is_an_error_naming_it(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    states = train(run)
    newest, other = two_copies(run)
    flip_in(newest, SECOND)
    flip_in(other, SECOND)
    for p in checkpoints(run):
        with pytest.raises(CorruptCheckpointError, match=f"{SECOND!r}.*no other copy of this shared .data holds it "
                                                          "intact"):
            load_checkpoint(p)
    assert _cli.main(["verify", "--repair", str(run)]) == 1
    out = capsys.readouterr().out
    assert out.count("NOT REPAIRED") == 2 and f"frozen tensor {SECOND!r}" in out
    with pytest.raises(CheckpointError):
        fit(run, steps=7, model=TwoFrozen(), ckpt_path="last", keep_newest=3, save_last=True)
    # the other tensor of each copy is still whole: a lazy read of it works
    with open_checkpoint(newest, verify=True) as r:
        assert_same_tensor(r.get_tensor(FIRST), states[step_of(newest)][FIRST], FIRST)


def test_export_and_load_from_checkpoint_read_the_other_copy(tmp_path: Path) -> None:
    from lightning_ort_ckpt._export._loading import load_from_checkpoint

    run = tmp_path / "run"
    states = train(run)
    newest, _ = two_copies(run)
    flip_in(newest, FIRST)
    with pytest.warns(CheckpointWarning, match="read from the other copy"):
        model = load_from_checkpoint(TwoFrozen, str(newest))
    assert_same_tensor(model.state_dict()[FIRST], states[6][FIRST], FIRST)
    with pytest.warns(CheckpointWarning, match="read from the other copy"), \
            open_checkpoint(newest, verify=True) as reader:
        module = reader.module_state()  # what an export reads
    assert_same_tensor(module.frozen[FIRST], states[6][FIRST], FIRST)


def test_damage_found_by_the_background_read_back_is_repaired(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Same size and mtime, and a link count moved with the change time: only a read-back finds it; the save that
    takes it writes a fresh copy from the other copy's bytes and relinks the checkpoints of the damaged one."""
    monkeypatch.setattr(limits, "VERIFY_EVERY", 4)
    read_backs = record_read_backs(monkeypatch)
    sh, module = sharing.FrozenSharing(), frozen_module()
    paths = [tmp_path / f"step={i}.ckpt" for i in range(1, 13)]

    def save(p: Path) -> None:
        ck = CheckpointContents(frozen=dict(module.state_dict()), properties={"tag": p.name})
        snap = sh.snapshot(ck, str(p), module)
        assert snap is not None
        sh.save(ck, str(p), snap, "auto")

    for p in paths[:4]:
        save(p)
    flip(data(paths[2]), keep_mtime=True)
    os.link(data(paths[2]), tmp_path / "extra-name")  # the link count moves with the change time
    found = None
    for i, p in enumerate(paths[4:], 5):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            save(p)
        if any("were repaired" in str(w.message) for w in caught):
            found = found or i
    sh.close()
    atomic.wait_for_cleanup()
    assert found is not None
    assert any(t.startswith("ort-ckpt-frozen-copies") for t, _ in read_backs)  # read back on the worker thread
    for p in paths:
        with CheckpointReader(p, heal=False) as r:  # every one whole in its own files
            assert torch.equal(r.load().frozen["weight"], module.weight)


def test_a_checkpoint_without_a_second_copy_fails_as_before(tmp_path: Path) -> None:
    """A checkpoint without a second copy (no other checkpoint records the tensor with its checksum) fails as
    before, naming the tensor."""
    module = frozen_module()
    from lightning_ort_ckpt.format import save_checkpoint

    path = tmp_path / "alone.ckpt"
    save_checkpoint(CheckpointContents(frozen=dict(module.state_dict())), path, external_data="params")
    flip(data(path), keep_mtime=False)
    with pytest.raises(CorruptCheckpointError, match="'weight'"):
        load_checkpoint(path)
    assert shared.repair([str(path)])[0].lost == ["weight"]


def test_a_healing_reader_goes_with_its_last_use(tmp_path: Path) -> None:
    """A reader that heals (the default) is freed by reference counting alone, as one that does not: in a reference
    cycle it, and its mapping of ``.data`` with every page a lazy read touched, outlived its use until a gc ran;
    ``ort-ckpt export`` held the weights' pages twice through the export (tests/conformance/test_memory.py)."""
    import gc
    import weakref

    from lightning_ort_ckpt.format import save_checkpoint

    path = tmp_path / "one.ckpt"
    save_checkpoint(CheckpointContents(frozen=dict(frozen_module().state_dict())), path, external_data="params")
    gc.disable()
    try:
        for heal in (False, True):
            reader = CheckpointReader(path, verify=True, heal=heal)
            with reader:
                state = reader.module_state()
            mapping = weakref.ref(reader._files._data_mm)
            gone = weakref.ref(reader)
            del reader
            assert gone() is None, f"heal={heal}: the reader outlives its last reference"
            del state
            assert mapping() is None, f"heal={heal}: the .data stays mapped after its tensors went"
    finally:
        gc.enable()


def test_a_damaged_shard_has_no_second_copy_and_last_falls_back(tmp_path: Path) -> None:
    """A sharded checkpoint folder keeps each shard once (no frozen sharing, no ``.data``): a frozen tensor damaged in
    a shard is not healed, not even from the identical bytes of an older folder beside it (another checkpoint, not
    a copy of this one); the load names the shard and the tensor, and "last" falls back to the older folder (the
    registry's fallback: ``_registry.scan``, ``_resume.resolve_last`` and ``falling_back``, one rank)."""
    from lightning_ort_ckpt._dcp._dcp_storage import load_sharded, save_sharded
    from lightning_ort_ckpt._restore._registry import scan
    from lightning_ort_ckpt._restore._resume import falling_back, resolve_last
    from lightning_ort_ckpt.format._store import store_for

    frozen = frozen_module().weight.detach()
    for step in (2, 4):
        save_sharded({"backbone": frozen, "head": torch.full((4,), float(step)), "global_step": step},
                     str(tmp_path / f"step={step}.ckpt"))
    shard = next((tmp_path / "step=4.ckpt").glob("shard-*"))
    assert not list(tmp_path.rglob("*.data"))  # nothing shared, nothing to heal from
    raw = bytearray(shard.read_bytes())
    at = raw.find(frozen.numpy().tobytes()[:64])
    assert at > 0
    raw[at + frozen.numel() * 2] ^= 0x40  # a byte in the middle of the frozen tensor
    shard.write_bytes(raw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CorruptCheckpointError, match=rf"{shard.name}.*'backbone@0,0' .*is damaged"):
            load_sharded({"backbone": torch.zeros_like(frozen)}, str(tmp_path / "step=4.ckpt"))
    assert not [w for w in caught if "other copy" in str(w.message)]

    entries = scan(str(tmp_path), store_for(str(tmp_path)))
    held: list[str] = []

    class Holder:
        def hold(self, path: str, found: Any) -> None:
            held.append(path)

    choice = resolve_last(entries, rank_zero=True, io=Holder(), store_of=store_for)
    assert choice.path == str(tmp_path / "step=4.ckpt") and choice.folder and not held  # taken by its metadata
    target = {"backbone": torch.zeros_like(frozen), "head": torch.zeros(4)}
    went: list[str] = []
    load = falling_back(lambda path: load_sharded(target, path), choice, lambda ok: ok, went.append, str(tmp_path))
    with pytest.warns(CheckpointWarning, match=rf"{shard.name}.*every rank falls back to .*step=2\.ckpt"):
        loaded = load(choice.path)
    assert went == [str(tmp_path / "step=2.ckpt")] and loaded["global_step"] == 2
    assert torch.equal(target["backbone"], frozen) and torch.equal(target["head"], torch.full((4,), 2.0))
