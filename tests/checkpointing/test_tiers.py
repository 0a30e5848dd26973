"""Checkpoint tiers: a fast node-local tier beside ``dirpath`` (``OrtCheckpoint(local=LocalTier(...))``).

Real Trainers on the small fit of ``helpers.fits`` (a linear model, 4 steps an epoch): the fast tier saves every K
steps with its own retention, in the format and with the commit of every save; ``fit(ckpt_path="last")`` takes the
newest step of any tier, the fast one first, falls back past a damaged or wiped fast tier, never to scratch while a
tier holds a readable checkpoint, and resumes bit for bit. With moto's S3 as the persistent tier, a valid fast tier
means no object of the store is read (the requests are counted at the endpoint). A persistent save on a fast-tier
step is the fast file, copied (promotion), never a damaged one. The processes that get real signals (SIGTERM,
SLURM's SIGUSR1) are in ``tests/checkpointing/test_tiers_signals.py``, the 2-rank runs (ModelParallel, DDP) in
``tests/checkpointing/test_tiers_sharded.py``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import pytorch_lightning as pl
import torch

from lightning_ort_ckpt import LocalTier, OrtCheckpoint, load_checkpoint
from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
from lightning_ort_ckpt._recovery._promotion import copy_verified
from lightning_ort_ckpt.errors import CheckpointConfigError, CheckpointWarning, CorruptCheckpointError
from lightning_ort_ckpt.format._store import store_for
from helpers.fits import fit, files_after_fit, make_trainer, name, run_fit

from helpers.damage import damaged_copy


def weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}


def callback(persistent: Path | str, fast: Path, every: int = 1, keep: int = 2, **kwargs: Any) -> OrtCheckpoint:
    """Persistent saves every 4 steps (once an epoch), the fast tier every ``every`` steps."""
    return OrtCheckpoint(persistent, every_n_train_steps=4, save_top_k=-1,
                         local=LocalTier(fast, every_n_train_steps=every, keep=keep), **kwargs)


def step_of(path: Path | str) -> int:
    return int(read_lightning_checkpoint(path)["global_step"])


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """The weights of an uninterrupted fit of 8 steps, without any checkpoint."""
    return weights(fit(pl.Callback(), 2, enable_checkpointing=False))


@pytest.mark.parametrize("async_save", [False, True])
def test_the_fast_tier_saves_every_k_steps_and_keeps_the_newest(tmp_path: Path, async_save: bool) -> None:
    fast, persistent = tmp_path / "fast", tmp_path / "persistent"
    fit(callback(persistent, fast, every=2, keep=2, async_save=async_save), 2)  # 8 steps
    assert files_after_fit(fast) == {"step=6.ckpt", "step=8.ckpt"}  # steps 2 and 4 rotated out
    for step in (6, 8):
        load_checkpoint(fast / f"step={step}.ckpt")  # whole, every checksum verified
        assert step_of(fast / f"step={step}.ckpt") == step
    assert files_after_fit(persistent) == {name(0, 4), name(1, 8)}  # the persistent tier as without a fast one


def test_keep_one_keeps_one(tmp_path: Path) -> None:
    fit(callback(tmp_path / "persistent", tmp_path / "fast", every=1, keep=1), 1)
    assert files_after_fit(tmp_path / "fast") == {"step=4.ckpt"}


def test_arguments_are_checked(tmp_path: Path) -> None:
    for bad in ({"every_n_train_steps": 0}, {"keep": 0}, {"keep": 1.5}, {"every_n_train_steps": True}):
        with pytest.raises(CheckpointConfigError, match="LocalTier"):
            LocalTier(tmp_path, **bad)
    with pytest.raises(CheckpointConfigError, match="node-local"):
        LocalTier("s3://bucket/run")
    with pytest.raises(CheckpointConfigError, match="folder of its own"):
        OrtCheckpoint(tmp_path, local=LocalTier(tmp_path))
    with pytest.raises(CheckpointConfigError, match="LocalTier or None"):
        OrtCheckpoint(tmp_path, local=str(tmp_path / "fast"))  # type: ignore[arg-type]


def interrupted(tmp_path: Path, steps: int, **kwargs: Any) -> tuple[Path, Path]:
    """A fit stopped after ``steps`` steps: the persistent tier holds step 4, the fast tier the last two steps."""
    fast, persistent = tmp_path / "fast", tmp_path / "persistent"
    fit(callback(persistent, fast, **kwargs), 2, max_steps=steps)
    return fast, persistent


def resumed(fast: Path, persistent: Path | str, **kwargs: Any) -> Any:
    return fit(callback(persistent, fast, **kwargs), 2, ckpt_path="last")


def test_last_resumes_from_the_fast_tier_bit_for_bit(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    fast, persistent = interrupted(tmp_path, 6)
    assert files_after_fit(fast) == {"step=5.ckpt", "step=6.ckpt"}
    assert files_after_fit(persistent) == {name(0, 4)}
    trainer = resumed(fast, persistent)
    assert trainer.ckpt_path == str(fast / "step=6.ckpt")
    assert trainer.lightning_module.steps_run == 2  # steps 7 and 8 only
    after = weights(trainer)
    assert after.keys() == reference.keys()
    assert all(torch.equal(after[k], reference[k]) for k in after)
    assert files_after_fit(fast) == {"step=7.ckpt", "step=8.ckpt"}  # the resumed fit's saves rotate the old out


def test_a_damaged_fast_checkpoint_falls_back_to_the_next_newest(tmp_path: Path,
                                                                 reference: dict[str, torch.Tensor]) -> None:
    fast, persistent = interrupted(tmp_path, 6)
    newest = fast / "step=6.ckpt"
    damaged_copy(newest, tmp_path / "bad.ckpt").replace(newest)
    with pytest.warns(CheckpointWarning, match="step=6.ckpt cannot be resumed from"):
        trainer = resumed(fast, persistent)
    assert trainer.ckpt_path == str(fast / "step=5.ckpt")
    assert trainer.lightning_module.steps_run == 3
    assert all(torch.equal(v, reference[k]) for k, v in weights(trainer).items())


@pytest.mark.parametrize("how", ["wiped", "every file damaged"])
def test_a_lost_fast_tier_falls_back_to_the_persistent_tier(tmp_path: Path, how: str,
                                                            reference: dict[str, torch.Tensor]) -> None:
    fast, persistent = interrupted(tmp_path, 6)
    for path in fast.iterdir():
        if how == "wiped":
            path.unlink()
        else:
            damaged_copy(path, tmp_path / "bad.ckpt").replace(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        trainer = resumed(fast, persistent)
    assert trainer.ckpt_path == str(persistent / name(0, 4))  # never from scratch beside a readable checkpoint
    assert trainer.lightning_module.steps_run == 4
    assert all(torch.equal(v, reference[k]) for k, v in weights(trainer).items())


def test_a_stale_fast_tier_loses_to_a_newer_persistent_step(tmp_path: Path) -> None:
    """A fast folder left on a node by an earlier part of the run (step 2) while another node went on to step 4:
    the newest step wins, wherever it is."""
    fast, persistent = interrupted(tmp_path, 4, every=2, keep=1)
    stale = tmp_path / "stale"
    stale.mkdir()
    fit(callback(tmp_path / "other", stale, every=2, keep=1), 2, max_steps=2)
    trainer = resumed(stale, persistent, every=2, keep=1)
    assert trainer.ckpt_path == str(persistent / name(0, 4))


def test_nothing_anywhere_starts_from_step_0(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="no checkpoint yet"):
        trainer = resumed(tmp_path / "fast", tmp_path / "persistent")
    assert trainer.ckpt_path is None and trainer.lightning_module.steps_run == 8




def test_a_valid_fast_tier_reads_no_object_of_the_persistent_store(tmp_path: Path, counted: Any,
                                                                   reference: dict[str, torch.Tensor]) -> None:
    """moto's S3 (through the counting proxy) as the persistent tier: the resume from the fast tier lists the
    store (names, sizes, dates: to know that it holds no newer step) but reads none of its objects."""
    proxy = counted
    options = {"key": "x", "secret": "y", "client_kwargs": {"endpoint_url": proxy.url}}
    bucket = f"tiers-{os.getpid()}-{id(tmp_path) % 100000}"
    fsspec.filesystem("s3", **options).mkdir(bucket)
    persistent = f"s3://{bucket}/run"
    fast = tmp_path / "fast"
    fit(callback(persistent, fast, storage_options=options), 2, max_steps=6)
    assert fsspec.filesystem("s3", **options).ls(f"{bucket}/run", refresh=True) == [f"{bucket}/run/{name(0, 4)}"]
    proxy.requests.clear()
    trainer = fit(callback(persistent, fast, storage_options=options), 2, ckpt_path="last", max_steps=6)
    assert trainer.ckpt_path == str(fast / "step=6.ckpt")
    reads = [r for r in proxy.requests if r.startswith("GET ") and not _listing(r)]
    assert reads == [], reads
    assert any(_listing(r) for r in proxy.requests), proxy.requests  # it did look at the store
    # and with the fast tier gone, the same command resumes from the store
    for path in fast.iterdir():
        path.unlink()
    proxy.requests.clear()
    trainer = fit(callback(persistent, fast, storage_options=options), 2, ckpt_path="last")
    assert trainer.ckpt_path == f"{persistent}/{name(0, 4)}"
    assert [r for r in proxy.requests if r.startswith("GET ") and not _listing(r)]
    assert all(torch.equal(v, reference[k]) for k, v in weights(trainer).items())


def _listing(request: str) -> bool:
    """A request for the names in a bucket (``ListObjectsV2``), not for an object's bytes."""
    return "list-type=" in request or request.split("?")[0].count("/") <= 1


class DumpsPerStep(pl.Callback):
    """Counts the checkpoint dicts Lightning builds at each step (every ``trainer.save_checkpoint`` builds one)."""

    def __init__(self) -> None:
        self.dumps: dict[int, int] = {}

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.dumps[trainer.global_step] = self.dumps.get(trainer.global_step, 0) + 1


@pytest.mark.parametrize("async_save", [False, True])
def test_a_persistent_save_on_a_fast_step_is_the_fast_file_copied(tmp_path: Path, async_save: bool) -> None:
    """Steps 4 and 8 are saved by both tiers: the checkpoint is built and written once, into the fast tier, and the
    persistent file is a copy of it, byte for byte."""
    fast, persistent, dumps = tmp_path / "fast", tmp_path / "persistent", DumpsPerStep()
    trainer = make_trainer(callback(persistent, fast, async_save=async_save), 2)
    trainer.callbacks.insert(0, dumps)
    run_fit(trainer)
    assert dumps.dumps == {step: 1 for step in range(1, 9)}  # one save a step, steps 4 and 8 included
    assert files_after_fit(persistent) == {name(0, 4), name(1, 8)}
    assert (persistent / name(1, 8)).read_bytes() == (fast / "step=8.ckpt").read_bytes()
    load_checkpoint(persistent / name(0, 4))
    assert step_of(persistent / name(0, 4)) == 4


def test_weights_only_persistent_saves_are_not_promoted(tmp_path: Path) -> None:
    """The fast tier holds whole states: a weights-only persistent file is saved on its own."""
    fast, persistent = tmp_path / "fast", tmp_path / "persistent"
    fit(callback(persistent, fast, save_weights_only=True), 1)
    assert "optimizer_states" not in read_lightning_checkpoint(persistent / name(0, 4))
    assert read_lightning_checkpoint(fast / "step=4.ckpt")["optimizer_states"]


def test_a_damaged_fast_file_is_never_promoted(tmp_path: Path) -> None:
    fast = tmp_path / "fast"
    fit(callback(tmp_path / "persistent", fast), 1)
    bad = damaged_copy(fast / "step=4.ckpt", tmp_path / "bad.ckpt")
    target = tmp_path / "copy" / "promoted.ckpt"
    target.parent.mkdir()
    with pytest.raises(CorruptCheckpointError, match="bad.ckpt"):
        copy_verified(str(bad), str(target), store_for(str(target)))
    assert not os.listdir(target.parent)
    copy_verified(str(fast / "step=4.ckpt"), str(target), store_for(str(target)))
    assert target.read_bytes() == (fast / "step=4.ckpt").read_bytes()


def test_last_orders_the_tiers_by_step_the_nearest_first_among_equals() -> None:
    """``_tiers.nearest_first`` on listings as the registry makes them: a remote file's step unknown without a
    download is its name's ``step=N``; a step unknown either way comes after every known one."""
    from lightning_ort_ckpt._restore._registry import Entry, Kind, State
    from lightning_ort_ckpt._recovery._tiers import nearest_first

    def entry(path: str, step: int | None = None, state: State = State.COMMITTED) -> Entry:
        return Entry(path, Kind.FILE, state, step)

    fast = [entry("/fast/step=8.ckpt", 8), entry("/fast/step=7.ckpt", 7)]
    persistent = [entry("s3://b/run/last.ckpt"), entry("s3://b/run/epoch=1-step=9.ckpt"),
                  entry("s3://b/run/epoch=1-step=8.ckpt"), entry("s3://b/run/epoch=0-step=4.ckpt"),
                  entry("s3://b/run/epoch=0-step=6.ckpt", state=State.HALF)]
    hpc = [entry("/root/hpc_ckpt_1.ckpt", 7), entry("/fast/step=8.ckpt", 8)]  # a path two tiers list: once
    assert [e.path for e in nearest_first([fast, persistent, hpc])] == [
        "s3://b/run/epoch=1-step=9.ckpt", "/fast/step=8.ckpt", "s3://b/run/epoch=1-step=8.ckpt", "/fast/step=7.ckpt",
        "/root/hpc_ckpt_1.ckpt", "s3://b/run/epoch=0-step=4.ckpt", "s3://b/run/last.ckpt",
        "s3://b/run/epoch=0-step=6.ckpt"]
