"""``OrtCheckpoint`` through real Trainers: which files exist after fit, and what the callback remembers.

Every "files after fit" check is an exact set comparison of the directory listing once the background unlinker is
done (``atomic.wait_for_cleanup``), so a leftover temporary file, a stale ``.data`` or a file that rotation should
have deleted fails the test; every checkpoint left is checked to be an ORT file that ORT 1.19.2 loads.

Setup: a linear model without dropout, 8 samples in batches of 2 (4 optimizer steps per epoch), no shuffling, one
validation batch per epoch whose logged ``val_loss`` is taken from a list indexed by ``current_epoch`` (so the
top-k is known in advance), no sanity check.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lightning_ort_ckpt import CheckpointSaveError, OrtCheckpoint, OrtCheckpointIO, open_checkpoint
from lightning_ort_ckpt.errors import CheckpointConfigError, CheckpointError, CheckpointWarning
from lightning_ort_ckpt.format import _atomic as atomic
from helpers.ort_reference import ort_api
from helpers.fits import Net, at_step, files_after_fit, fit, make_net_class, make_trainer, name, run_fit


ORT_MAGIC = b"ODTC"


@pytest.fixture(autouse=True)
def _restore_seed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """seed_everything sets PL_GLOBAL_SEED/PL_SEED_WORKERS; undo that after each test."""
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)


# -- model, data, trainer ---------------------------------------------------------------------------------------


def assert_ort_files(directory: Any, names: set[str] | None = None) -> None:
    """Each checkpoint in ``names`` (default: all in ``directory``) is an ORT file that ORT 1.19.2 loads."""
    api = ort_api()
    for n in sorted(names if names is not None else files_after_fit(directory)):
        if n.endswith(atomic.DATA_SUFFIX):
            continue
        path = os.path.join(directory, n)
        with open(path, "rb") as f:
            assert f.read(8)[4:8] == ORT_MAGIC, f"{n} is not an ORT checkpoint"
        api.CheckpointState.load_checkpoint(path)


def ranked(callback: Any) -> dict[str, float]:
    """best_k_models as base name -> score."""
    return {os.path.basename(p): float(v) for p, v in callback.best_k_models.items()}


def stored_state(path: Any) -> dict[str, Any]:
    """The OrtCheckpoint state recorded inside a file (read back through the plugin)."""
    from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint

    callbacks = read_lightning_checkpoint(path)["callbacks"]
    (state,) = [v for k, v in callbacks.items() if k.startswith("OrtCheckpoint")]
    return state


# -- 1. the plugin is installed by the callback ------------------------------------------------------------------


def test_callback_installs_plugin_and_writes_ort_files(tmp_path: Any) -> None:
    cb = OrtCheckpoint(dirpath=tmp_path)  # no plugins argument
    trainer = fit(cb, 2)
    assert isinstance(trainer.strategy.checkpoint_io, OrtCheckpointIO)
    assert trainer.strategy.checkpoint_io is cb.checkpoint_io
    assert files_after_fit(tmp_path) == {at_step(8)}  # save_top_k=1: the epoch-0 file was replaced
    assert_ort_files(tmp_path)  # checks bytes 4..8 == b"ODTC" and loads in ORT


# -- 2. which files each trigger leaves --------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_every_n_train_steps(tmp_path: Any, async_save: bool) -> None:
    cb = OrtCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, async_save=async_save)
    fit(cb, 2)  # 8 steps
    assert files_after_fit(tmp_path) == {at_step(3), at_step(6)}
    assert_ort_files(tmp_path)


def test_every_n_train_steps_keeps_one_by_default(tmp_path: Any) -> None:
    cb = OrtCheckpoint(dirpath=tmp_path, every_n_train_steps=3)  # save_top_k=1
    fit(cb, 2)
    assert files_after_fit(tmp_path) == {at_step(6)}
    assert_ort_files(tmp_path)


def test_every_n_epochs(tmp_path: Any) -> None:
    cb = OrtCheckpoint(dirpath=tmp_path, every_n_epochs=2, save_top_k=-1)
    fit(cb, 4)
    assert files_after_fit(tmp_path) == {name(1, 8), name(3, 16)}
    assert_ort_files(tmp_path)


def test_train_time_interval(tmp_path: Any) -> None:
    # each step sleeps 10 ms, far past the 1 ms interval: every step end is due, deterministically
    cb = OrtCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(milliseconds=1), save_top_k=-1)
    fit(cb, 1, sleep=0.01)
    assert files_after_fit(tmp_path) == {at_step(s) for s in range(1, 5)}
    assert_ort_files(tmp_path)


def test_zero_train_time_interval_saves_every_step(tmp_path: Any) -> None:
    cb = OrtCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(0), save_top_k=-1)
    fit(cb, 1)
    assert files_after_fit(tmp_path) == {at_step(s) for s in range(1, 5)}


def test_step_and_epoch_triggers_combine(tmp_path: Any) -> None:
    # ModelCheckpoint refuses this combination; OrtCheckpoint saves on either trigger
    cb = OrtCheckpoint(dirpath=tmp_path, every_n_train_steps=3, every_n_epochs=1, save_top_k=-1)
    fit(cb, 2)
    assert files_after_fit(tmp_path) == {at_step(3), at_step(4), at_step(6), at_step(8)}
    assert_ort_files(tmp_path)


VALS = [5.0, 3.0, 4.0, 1.0, 2.0]  # val_loss per epoch


@pytest.mark.parametrize(("mode", "async_save"), [("min", False), ("max", False), ("min", True)])
def test_monitor_top_k(tmp_path: Any, mode: str, async_save: bool) -> None:
    cb = OrtCheckpoint(dirpath=tmp_path, monitor="val_loss", mode=mode, save_top_k=2, async_save=async_save)
    fit(cb, len(VALS), VALS)
    # min: 1.0 (epoch 3) and 2.0 (epoch 4); max: 5.0 (epoch 0) and 4.0 (epoch 2)
    best, second = (3, 4) if mode == "min" else (0, 2)
    expected = {name(best, 4 * best + 4): VALS[best], name(second, 4 * second + 4): VALS[second]}
    assert files_after_fit(tmp_path) == set(expected)
    assert ranked(cb) == expected
    assert os.path.basename(cb.best_model_path) == name(best, 4 * best + 4)
    assert float(cb.best_model_score) == VALS[best]
    assert os.path.basename(cb.kth_best_model_path) == name(second, 4 * second + 4)
    assert_ort_files(tmp_path)


def test_save_last_copy(tmp_path: Any) -> None:
    cb = OrtCheckpoint(dirpath=tmp_path, save_last=True)
    fit(cb, 2)
    assert files_after_fit(tmp_path) == {name(1, 8), "last.ckpt"}
    assert not os.path.islink(tmp_path / "last.ckpt")
    assert cb.last_model_path == str(tmp_path / "last.ckpt")
    assert_ort_files(tmp_path)


@pytest.mark.parametrize(("external_data", "async_save"), [("auto", False), ("params", False), ("params", True)])
def test_save_last_link(tmp_path: Any, external_data: str, async_save: bool) -> None:
    cb = OrtCheckpoint(dirpath=tmp_path, save_last="link", external_data=external_data,  # type: ignore[arg-type]
                       async_save=async_save)
    fit(cb, 2)
    newest = name(1, 8)
    expected = {newest, "last.ckpt"}
    if external_data == "params":
        expected |= {newest + ".data", "last.ckpt.data"}
    assert files_after_fit(tmp_path) == expected  # the epoch-0 file and its .data are gone
    assert os.readlink(tmp_path / "last.ckpt") == newest  # relative, to the newest file
    if external_data == "params":
        assert os.readlink(tmp_path / "last.ckpt.data") == newest + ".data"
    assert cb.last_model_path == str(tmp_path / "last.ckpt")
    assert_ort_files(tmp_path)  # last.ckpt loads in ORT through the link (and its .data through the other one)


def test_last_link_never_dangles_while_rotating(tmp_path: Any, monkeypatch: Any) -> None:
    """Each deletion happens only once last.ckpt no longer points at the file being deleted."""
    remove, seen = atomic.remove, []

    def checked_remove(path: str) -> None:
        seen.append(path)
        assert os.path.exists(tmp_path / "last.ckpt"), f"last.ckpt dangles when {path} is deleted"
        assert os.path.realpath(tmp_path / "last.ckpt") != os.path.realpath(path)
        remove(path)

    monkeypatch.setattr(atomic, "remove", checked_remove)
    fit(OrtCheckpoint(dirpath=tmp_path, save_last="link"), 3)
    assert len(seen) == 2 and files_after_fit(tmp_path) == {name(2, 12), "last.ckpt"}


def test_callback_settings_conflicting_with_the_trainers_plugin_raise(tmp_path: Any) -> None:
    """One plugin, configured in one place: settings given to the callback and a plugin given to the Trainer are
    an error at setup (before any training), not a silent choice."""
    cb = OrtCheckpoint(dirpath=tmp_path, async_save=True)
    with pytest.raises(CheckpointConfigError, match="the Trainer already has an OrtCheckpointIO"):
        fit(cb, 1, plugins=[OrtCheckpointIO()])
    assert not list(tmp_path.iterdir())


def test_callback_adopts_the_trainers_plugin_and_takes_one_of_its_own(tmp_path: Any) -> None:
    io = OrtCheckpointIO(external_data="params")
    cb = OrtCheckpoint(dirpath=tmp_path / "a")  # no settings: the Trainer's plugin is the one
    trainer = fit(cb, 1, plugins=[io])
    assert cb.checkpoint_io is io is trainer.strategy.checkpoint_io
    assert all(os.path.exists(str(p) + ".data") for p in (tmp_path / "a").glob("*.ckpt"))
    mine = OrtCheckpointIO(external_data="params")
    cb = OrtCheckpoint(dirpath=tmp_path / "b", checkpoint_io=mine)
    assert fit(cb, 1).strategy.checkpoint_io is mine
    with pytest.raises(CheckpointConfigError, match="async_save configure the plugin"):
        OrtCheckpoint(checkpoint_io=mine, async_save=True)


@pytest.mark.parametrize("kwargs", [dict(every_n_train_steps=-1), dict(keep_newest=0), dict(share_frozen="yes"),
                                    dict(external_data="sometimes"),
                                    dict(save_weights_only=True, include_optimizer_state=True)])
def test_configuration_errors_are_one_type(kwargs: dict[str, Any]) -> None:
    with pytest.raises(CheckpointConfigError):
        OrtCheckpoint(**kwargs)


def test_dirpath_that_is_a_file_fails_at_setup(tmp_path: Any) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(CheckpointConfigError, match="is a file, not a directory"):
        fit(OrtCheckpoint(dirpath=tmp_path / "file"), 1)


def test_async_saves_queued_at_exit_are_written(tmp_path: Any) -> None:
    """A program that ends right after async saves (outside fit, no wait()) still gets every file."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import torch
        from lightning_ort_ckpt import CheckpointContents, OrtCheckpointIO
        io = OrtCheckpointIO(async_save=True)
        for i in range(3):
            io.save_checkpoint({{"state_dict": {{"w": torch.full((256, 1024), float(i))}}, "epoch": i}},
                               {str(tmp_path)!r} + f"/{{i}}.ckpt")
    """)
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["0.ckpt", "1.ckpt", "2.ckpt"]
    for i in range(3):
        assert open_checkpoint(tmp_path / f"{i}.ckpt").get_tensor("w")[0, 0] == float(i)


def test_keep_newest_without_monitor(tmp_path: Any) -> None:
    cb = OrtCheckpoint(dirpath=tmp_path, keep_newest=2)
    fit(cb, 4)
    assert files_after_fit(tmp_path) == {name(2, 12), name(3, 16)}


def test_keep_newest_with_top_k(tmp_path: Any) -> None:
    # min mode, top 2 of [1, 5, 4, 3, 2]: epoch 0 is the best and the oldest file, outside the newest 2, and stays;
    # epoch 3 (3.0) leaves the top 2 when epoch 4 (2.0) comes but is one of the newest 2, so it stays too;
    # epochs 1 and 2 left the top 2 and then the newest 2
    vals = [1.0, 5.0, 4.0, 3.0, 2.0]
    cb = OrtCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, keep_newest=2)
    fit(cb, 5, vals)
    assert files_after_fit(tmp_path) == {name(0, 4), name(3, 16), name(4, 20)}
    assert ranked(cb) == {name(0, 4): 1.0, name(4, 20): 2.0}
    assert os.path.basename(cb.best_model_path) == name(0, 4)
    assert_ort_files(tmp_path)


@pytest.mark.parametrize("kwargs", [{"save_weights_only": True}, {"include_optimizer_state": False}, {}])
def test_weights_only(tmp_path: Any, kwargs: dict[str, Any]) -> None:
    cb = OrtCheckpoint(dirpath=tmp_path, **kwargs)
    fit(cb, 1)
    assert files_after_fit(tmp_path) == {name(0, 4)}
    with open_checkpoint(tmp_path / name(0, 4)) as ck:
        assert (ck.optimizer_groups == {}) == bool(kwargs)  # the default keeps the optimizer state
    assert_ort_files(tmp_path)


# -- 3. combined triggers and the stale metric -------------------------------------------------------------------

STALE_VALS = [3.0, 1.0, 2.0]  # val_loss computed at steps 4, 8 and 12


@pytest.mark.parametrize(("save_on_train_epoch_end", "async_save"), [
    pytest.param(False, False, id="after-validation"),
    pytest.param(False, True, id="after-validation-async"),
    pytest.param(None, False, id="default"),
])
def test_step_trigger_with_monitor_does_not_rank_stale_values(tmp_path: Any, save_on_train_epoch_end: bool | None,
                                                              async_save: bool) -> None:
    """every_n_train_steps=2 and monitor="val_loss" in one callback; validation once per epoch (4 steps).

    The documented rule (callback.py, "No stale ranking"): a save is ranked by the monitored value only if that
    value was computed at the step being saved. A save due at a step where the value is older is written unranked
    (not in best_k_models; without keep_newest only the newest unranked file is kept), and the value is ranked when
    it is next computed: each validation is a trigger of its own, saving when it enters the top k. Every file records
    in ``current_score_step`` the step its monitored value comes from.

    Steps: 2 - no value yet, nothing saved; 4 - validation (3.0): ranked; 6 - value from step 4: unranked;
    8 - validation (1.0): ranked; 10 - value from step 8: unranked, replaces the step-6 file; 12 - validation (2.0):
    ranked, the step-4 file (3.0) leaves the top 2.
    """
    cb = OrtCheckpoint(dirpath=tmp_path, every_n_train_steps=2, monitor="val_loss", save_top_k=2,
                       save_on_train_epoch_end=save_on_train_epoch_end, async_save=async_save)
    fit(cb, 3, STALE_VALS)
    assert ranked(cb) == {at_step(8): 1.0, at_step(12): 2.0}  # the ranked files: exactly those saved at validation
    assert os.path.basename(cb.best_model_path) == at_step(8) and float(cb.best_model_score) == 1.0
    assert files_after_fit(tmp_path) == {at_step(8), at_step(10), at_step(12)}
    assert at_step(10) not in ranked(cb)  # saved on the step trigger with the step-8 value: not ranked
    # when the step-10 file was written, the step-6 file (stale value from step 4) existed and was not ranked either
    assert {os.path.basename(p) for p in stored_state(tmp_path / at_step(10))["best_k_models"]} == \
        {at_step(4), at_step(8)}
    # current_score_step: the step the score comes from; the callback's is that of its latest score (current_score)
    assert cb.current_score_step == 12 and float(cb.current_score) == 2.0
    # and each file recorded the step its value was computed at: the best file's score was computed at step 8
    assert stored_state(tmp_path / at_step(8))["current_score_step"] == 8
    assert stored_state(tmp_path / at_step(10))["current_score_step"] == 8
    assert stored_state(tmp_path / at_step(12))["current_score_step"] == 12
    assert_ort_files(tmp_path)


# -- 4. resume -----------------------------------------------------------------------------------------------------


def callback_state(cb: Any) -> dict[str, Any]:
    """The callback's ranking state with paths relative to its directory (runs in different directories compare)."""
    def rel(p: str) -> str:
        return os.path.relpath(p, cb.dirpath) if p else p

    def val(t: Any) -> Any:
        return None if t is None else float(t)

    return {"best_model_path": rel(cb.best_model_path), "best_model_score": val(cb.best_model_score),
            "best_k_models": {rel(p): val(v) for p, v in cb.best_k_models.items()},
            "kth_best_model_path": rel(cb.kth_best_model_path), "kth_value": val(cb.kth_value),
            "current_score": val(cb.current_score), "current_score_step": cb.current_score_step,
            "last_model_path": rel(cb.last_model_path)}


RESUME_VALS = [3.0, 1.0, 2.0, 0.5]


@pytest.fixture(scope="module")
def resumed_from_last(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Combined triggers, top 2 and save_last="link": 4 epochs in one go, and 2 + fit(ckpt_path="last") to 4."""
    def callback(d: Any) -> Any:
        return OrtCheckpoint(dirpath=d, every_n_train_steps=2, monitor="val_loss", save_top_k=2, save_last="link",
                             save_on_train_epoch_end=False)

    one, two = tmp_path_factory.mktemp("uninterrupted"), tmp_path_factory.mktemp("interrupted")
    full = fit(callback(one), 4, RESUME_VALS)
    first = fit(callback(two), 2, RESUME_VALS)
    first_files, first_link = files_after_fit(two), os.readlink(two / "last.ckpt")
    resumed = fit(callback(two), 4, RESUME_VALS, ckpt_path="last")  # a new callback, as after a restart
    return {"full": full, "first": first, "first_files": first_files, "first_link": first_link, "resumed": resumed,
            "full_files": files_after_fit(one), "resumed_files": files_after_fit(two), "dirs": (one, two)}


def test_resume_last_continues_with_the_uninterrupted_state(resumed_from_last: dict[str, Any]) -> None:
    r = resumed_from_last
    assert r["first_files"] == {at_step(4), at_step(6), at_step(8), "last.ckpt"}
    assert r["first_link"] == at_step(8)
    # the newest file there: the step-8 file or the link to it (same modification time)
    assert r["resumed"].ckpt_path in {os.path.join(r["dirs"][1], n) for n in ("last.ckpt", at_step(8))}
    assert r["resumed"].lightning_module.steps_run == 8 and r["resumed"].global_step == 16  # from step 8 on
    full_cb, resumed_cb = r["full"].checkpoint_callback, r["resumed"].checkpoint_callback
    assert callback_state(resumed_cb) == callback_state(full_cb)
    assert callback_state(full_cb)["best_k_models"] == {at_step(8): 1.0, at_step(16): 0.5}
    assert callback_state(full_cb)["current_score_step"] == 16
    assert callback_state(full_cb)["last_model_path"] == "last.ckpt"
    assert os.readlink(os.path.join(r["dirs"][1], "last.ckpt")) == at_step(16)
    for key, value in r["full"].lightning_module.state_dict().items():  # same training too, bit for bit
        assert torch.equal(r["resumed"].lightning_module.state_dict()[key], value), key
    assert_ort_files(r["dirs"][1], r["resumed_files"])


def test_resume_last_leaves_the_same_files(resumed_from_last: dict[str, Any]) -> None:
    r = resumed_from_last
    assert r["full_files"] == {at_step(8), at_step(14), at_step(16), "last.ckpt"}
    assert r["resumed_files"] == r["full_files"]


@pytest.mark.parametrize("keep_newest", [None, 1])
def test_resume_best(tmp_path: Any, keep_newest: int | None) -> None:
    """fit(ckpt_path="best") in a new Trainer with the same callback; the file resumed from is never deleted."""
    vals = [5.0, 4.0, 3.0, 2.0]  # each epoch better: the best after 2 epochs is the newest file, epoch 1

    def callback(d: Any) -> Any:
        return OrtCheckpoint(dirpath=d, monitor="val_loss", save_top_k=1, keep_newest=keep_newest)

    full_cb = callback(tmp_path / "full")
    full = fit(full_cb, 4, vals)
    cb = callback(tmp_path / "resumed")
    fit(cb, 2, vals)
    assert files_after_fit(tmp_path / "resumed") == {name(1, 8)}
    resumed = fit(cb, 4, vals, ckpt_path="best")
    assert resumed.ckpt_path == str(tmp_path / "resumed" / name(1, 8))
    assert resumed.lightning_module.steps_run == 8 and resumed.global_step == 16
    assert callback_state(cb) == callback_state(full_cb)
    assert callback_state(cb)["best_k_models"] == {name(3, 16): 2.0}
    assert files_after_fit(tmp_path / "full") == {name(3, 16)}
    # epoch 1 left the top 1 (and the newest 1) at epoch 2, but it is the file this run resumed from
    assert files_after_fit(tmp_path / "resumed") == {name(1, 8), name(3, 16)}
    assert_ort_files(tmp_path / "resumed")


# -- 5. safety -----------------------------------------------------------------------------------------------------


def test_files_outside_dirpath_are_never_deleted(tmp_path: Any) -> None:
    """A run resumed from a copy elsewhere, writing into a new directory: its state names the old directory's best
    file, which rotation in the new directory must leave alone (as must it the file resumed from)."""
    fit(OrtCheckpoint(dirpath=tmp_path / "a"), 2)
    assert files_after_fit(tmp_path / "a") == {name(1, 8)}
    os.makedirs(tmp_path / "c")
    with open(tmp_path / "a" / name(1, 8), "rb") as src, open(tmp_path / "c" / "resume.ckpt", "wb") as dst:
        dst.write(src.read())
    cb = OrtCheckpoint(dirpath=tmp_path / "b")  # save_top_k=1: each save replaces the previous best file
    fit(cb, 4, ckpt_path=str(tmp_path / "c" / "resume.ckpt"))
    assert cb.best_model_path == str(tmp_path / "b" / name(3, 16))
    assert files_after_fit(tmp_path / "a") == {name(1, 8)}
    assert files_after_fit(tmp_path / "c") == {"resume.ckpt"}
    assert files_after_fit(tmp_path / "b") == {name(3, 16)}
    for d in ("a", "b", "c"):
        assert_ort_files(tmp_path / d)


def _damage(path: Any, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep if keep >= 0 else os.path.getsize(path) // 2)


def test_resume_last_skips_a_damaged_newest_file(tmp_path: Any) -> None:
    fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 3)
    assert files_after_fit(tmp_path) == {name(0, 4), name(1, 8), name(2, 12)}
    for i, n in enumerate([name(0, 4), name(1, 8), name(2, 12)]):  # distinct modification times, oldest first
        os.utime(tmp_path / n, (1_000_000 + i, 1_000_000 + i))
    _damage(tmp_path / name(2, 12), -1)  # truncated to half (and now the newest by mtime)
    with pytest.warns(CheckpointWarning, match=re.escape(str(tmp_path / name(2, 12)))):
        trainer = fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 4, ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / name(1, 8))
    assert trainer.lightning_module.steps_run == 8 and trainer.global_step == 16
    # the damaged file is left as it was; the new step-12 save takes the next free name
    assert files_after_fit(tmp_path) == {name(0, 4), name(1, 8), name(2, 12), name(2, 12, 1), name(3, 16)}
    assert_ort_files(tmp_path, files_after_fit(tmp_path) - {name(2, 12)})


def test_resume_last_with_every_file_damaged_raises_one_error_listing_each(tmp_path: Any) -> None:
    """O1: dirpath holds checkpoints and none can be resumed: one error naming each and why, before training."""
    fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 2)
    _damage(tmp_path / name(0, 4), -1)  # truncated to half
    _damage(tmp_path / name(1, 8), 0)  # empty
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError) as raised:
        fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 2, ckpt_path="last")
    message = str(raised.value)
    assert message.startswith(f'{tmp_path}: ckpt_path="last": none of its 2 checkpoint(s) can be resumed from:\n'), \
        message
    for damaged in (name(1, 8), name(0, 4)):
        assert f"\n  {damaged}: " in message, message
    assert 'resume_fallback="scratch"' in message
    assert files_after_fit(tmp_path) == {name(0, 4), name(1, 8)}  # nothing trained, nothing written


def test_resume_last_with_every_file_damaged_starts_fresh_when_asked(tmp_path: Any) -> None:
    fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 2)
    assert files_after_fit(tmp_path) == {name(0, 4), name(1, 8)}
    _damage(tmp_path / name(0, 4), -1)  # truncated to half
    _damage(tmp_path / name(1, 8), 0)  # empty
    with pytest.warns(CheckpointWarning) as record:
        trainer = fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1, resume_fallback="scratch"), 2,
                      ckpt_path="last")
    damaged = {str(tmp_path / name(0, 4)), str(tmp_path / name(1, 8))}
    assert {n for n in damaged for w in record if issubclass(w.category, CheckpointWarning) and n in str(w.message)} \
        == damaged
    assert trainer.ckpt_path is None
    assert trainer.lightning_module.steps_run == 8 and trainer.global_step == 8  # from scratch
    assert files_after_fit(tmp_path) == {name(0, 4), name(1, 8), name(0, 4, 1), name(1, 8, 1)}
    assert_ort_files(tmp_path, {name(0, 4, 1), name(1, 8, 1)})


@pytest.mark.parametrize("writer", ["ModelCheckpoint", "OrtCheckpoint"])
def test_resume_last_skips_weights_only_files(tmp_path: Any, writer: str) -> None:
    """A second callback writes weights-only files into the same directory (torch files from ModelCheckpoint, ORT
    files from OrtCheckpoint): "last" skips them, though newer, and resumes from the newest full checkpoint."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    second_class = ModelCheckpoint if writer == "ModelCheckpoint" else OrtCheckpoint
    second = second_class(dirpath=tmp_path, filename="weights-{step}", save_weights_only=True, every_n_train_steps=4,
                          save_top_k=-1)
    trainer = make_trainer(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 2)
    trainer.callbacks.append(second)
    run_fit(trainer)
    assert files_after_fit(tmp_path) == {name(0, 4), name(1, 8), "weights-step=4.ckpt", "weights-step=8.ckpt"}
    for i, n in enumerate([name(0, 4), name(1, 8), "weights-step=4.ckpt", "weights-step=8.ckpt"]):
        os.utime(tmp_path / n, (1_000_000 + i, 1_000_000 + i))  # the weights-only files are the newest
    with pytest.warns(CheckpointWarning, match="weights only"):
        resumed = fit(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1), 3, ckpt_path="last")
    assert resumed.ckpt_path == str(tmp_path / name(1, 8))
    assert resumed.lightning_module.steps_run == 4 and resumed.global_step == 12


class SlashNet(Net):
    """Logs its validation value as "val/loss": with auto_insert_metric_name the file names hold a "/"."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", torch.tensor(float(self.vals[self.current_epoch])))


def test_resume_last_finds_files_in_sub_folders_of_metric_names(tmp_path: Any) -> None:
    def callback() -> Any:
        return OrtCheckpoint(dirpath=tmp_path, monitor="val/loss", filename="{epoch}-{val/loss:.1f}", save_top_k=-1)

    fit(callback(), 2, [3.0, 2.0], net_class=SlashNet)
    assert files_after_fit(tmp_path) == {"epoch=0-val", "epoch=1-val"}  # the "/" made folders
    assert files_after_fit(tmp_path / "epoch=1-val") == {"loss=2.0.ckpt"}
    resumed = fit(callback(), 3, [3.0, 2.0, 1.0], ckpt_path="last", net_class=SlashNet)
    assert resumed.ckpt_path == str(tmp_path / "epoch=1-val" / "loss=2.0.ckpt")
    assert resumed.lightning_module.steps_run == 4 and resumed.global_step == 12
    assert files_after_fit(tmp_path / "epoch=2-val") == {"loss=1.0.ckpt"}


@pytest.mark.parametrize("case", ["templated-last", "link"])
def test_keep_newest_after_resume_leaves_the_uninterrupted_files(tmp_path: Any, case: str) -> None:
    """keep_newest=2 with every_n_train_steps=2. "templated-last": CHECKPOINT_NAME_LAST = "{epoch}-last" (a copy),
    never counted among the newest; "link": save_last="link", resumed through the link, whose old target rotates
    out once the link has moved on. Both end with the files of the uninterrupted run."""
    def callback(d: Any) -> Any:
        cb = OrtCheckpoint(dirpath=d, every_n_train_steps=2, keep_newest=2,
                           save_last=True if case == "templated-last" else "link")
        if case == "templated-last":
            cb.CHECKPOINT_NAME_LAST = "{epoch}-last"
        return cb

    fit(callback(tmp_path / "full"), 4)
    expected = {at_step(14), at_step(16), "epoch=3-last.ckpt" if case == "templated-last" else "last.ckpt"}
    assert files_after_fit(tmp_path / "full") == expected
    fit(callback(tmp_path / "resumed"), 2)
    assert files_after_fit(tmp_path / "resumed") == {at_step(6), at_step(8),
                                                     "epoch=1-last.ckpt" if case == "templated-last" else "last.ckpt"}
    resumed = fit(callback(tmp_path / "resumed"), 4, ckpt_path="last")
    resumed_from = "epoch=1-last.ckpt" if case == "templated-last" else "last.ckpt"  # newest; the link wins a tie
    assert resumed.ckpt_path == str(tmp_path / "resumed" / resumed_from)
    assert resumed.global_step == 16 and resumed.lightning_module.steps_run == 8
    assert files_after_fit(tmp_path / "resumed") == expected
    assert_ort_files(tmp_path / "resumed")


def test_a_path_given_to_resume_from_is_kept(tmp_path: Any) -> None:
    """Unlike the file "last" resolves to, a file named by path is never rotated out (as in ModelCheckpoint)."""
    fit(OrtCheckpoint(dirpath=tmp_path, every_n_train_steps=2, keep_newest=2), 2)
    resumed = fit(OrtCheckpoint(dirpath=tmp_path, every_n_train_steps=2, keep_newest=2), 4,
                  ckpt_path=str(tmp_path / at_step(6)))
    assert resumed.global_step == 16
    # step 8's file of the first run is unknown to the state of step 6 and stays, as with ModelCheckpoint
    assert files_after_fit(tmp_path) == {at_step(6), at_step(8), at_step(14), at_step(16)}


# -- 6. both Lightning packages --------------------------------------------------------------------------------------


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
@pytest.mark.parametrize("explicit_plugin", [False, True])
def test_lightning_packages(tmp_path: Any, package: str, explicit_plugin: bool) -> None:
    if package == "lightning.pytorch":
        import lightning.pytorch as trainer_module

        from lightning_ort_ckpt.lightning import OrtCheckpoint as Callback
        from lightning_ort_ckpt.lightning import OrtCheckpointIO as Plugin
    else:
        trainer_module = pl
        from lightning_ort_ckpt import OrtCheckpoint as Callback  # type: ignore[no-redef]
        from lightning_ort_ckpt import OrtCheckpointIO as Plugin  # type: ignore[no-redef]
    cb = Callback(dirpath=tmp_path, save_top_k=-1)
    kwargs: dict[str, Any] = {"plugins": [Plugin(external_data="params")]} if explicit_plugin else {}
    trainer = fit(cb, 2, trainer_module=trainer_module, net_class=make_net_class(trainer_module.LightningModule),
                  **kwargs)
    assert type(trainer.strategy.checkpoint_io) is Plugin  # the named class of that copy of Lightning
    assert cb.checkpoint_io is trainer.strategy.checkpoint_io
    if explicit_plugin:
        assert cb.checkpoint_io is kwargs["plugins"][0]  # the callback writes through the plugin it was given
    expected = {name(0, 4), name(1, 8)}
    if explicit_plugin:
        expected |= {n + ".data" for n in expected}
    assert files_after_fit(tmp_path) == expected
    assert_ort_files(tmp_path)


# -- 7. asynchronous saving: errors in the background ----------------------------------------------------------------


def _fail_after_first_save(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the plugin's background writer fail (OSError) on every save after the first; returns the saved paths."""
    from lightning_ort_ckpt._sharing import _policy as storage  # where the plugin's saves go (its Decision.write)

    real, calls = storage.save_checkpoint, []

    def flaky(ck: Any, path: str, **kwargs: Any) -> Any:
        calls.append(os.path.basename(path))
        if len(calls) > 1:
            raise OSError(28, "No space left on device (injected)")
        return real(ck, path, **kwargs)

    monkeypatch.setattr(storage, "save_checkpoint", flaky)
    return calls


def test_async_error_surfaces_at_the_next_save(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fail_after_first_save(monkeypatch)
    trainer = make_trainer(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1, async_save=True), 4)
    with pytest.raises(CheckpointSaveError, match="No space left"):
        # 4 steps of 50 ms between saves: the step-8 failure is known well before the step-12 save
        run_fit(trainer, sleep=0.05)
    assert calls == [name(0, 4), name(1, 8)]  # the step-12 save raised the step-8 error and queued nothing
    assert trainer.global_step == 12  # raised at the next save, not at the end of fit
    assert files_after_fit(tmp_path) == {name(0, 4)}  # nothing half-written is left
    assert_ort_files(tmp_path)


def test_async_error_surfaces_at_the_end_of_fit(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fail_after_first_save(monkeypatch)
    trainer = make_trainer(OrtCheckpoint(dirpath=tmp_path, save_top_k=-1, async_save=True), 2)
    with pytest.raises(CheckpointSaveError, match="No space left"):
        run_fit(trainer)  # the last save fails in the background: fit must not return as if it was written
    assert calls == [name(0, 4), name(1, 8)]
    assert trainer.global_step == 8
    assert files_after_fit(tmp_path) == {name(0, 4)}
    assert_ort_files(tmp_path)


def test_verbose_logs_what_each_save_is_where_and_why(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """#33 point 5: one line per save, as ModelCheckpoint's (it logs a ranked save itself): what, where, why."""
    cb = OrtCheckpoint(dirpath=tmp_path, monitor="val_loss", every_n_train_steps=2, save_last=True, verbose=True,
                       save_top_k=1, keep_newest=1)
    with caplog.at_level("INFO", logger="pytorch_lightning.utilities.rank_zero"):
        fit(cb, 2, [1.0, 0.5])
    lines = [r.getMessage() for r in caplog.records if "global step" in r.getMessage()]
    unranked = (f"Epoch 1, global step 6: saving an unranked checkpoint to {str(tmp_path / name(1, 6))!r} (training "
                "batch end; 'val_loss'=1.00000 was computed at step 4, not this one: not ranked, kept as one of the "
                "newest)")
    assert unranked in lines, lines
    assert f"Epoch 1, global step 6: saving the last checkpoint to {str(tmp_path / 'last.ckpt')!r} (training batch " \
           "end)" in lines, lines
    assert any(line.startswith("Epoch 1, global step 8: 'val_loss' reached 0.50000") for line in lines), lines
