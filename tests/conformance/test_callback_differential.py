"""``OrtCheckpoint`` against Lightning's own ``ModelCheckpoint``: the same seeded Trainer with one or the other,
interrupted, resumed (in a new Trainer, and by a second ``fit`` on the same Trainer), with ``EarlyStopping`` and
``LearningRateMonitor``; compared on the files kept, the callback's state, the loop progress (live and stored in
``last.ckpt``), early stopping, the learning rates logged and the final weights.

Every difference between the two is either absent here or listed in docs/callback.md ("Differences from
ModelCheckpoint") with its reason; the configurations below are those where the two must agree. The improvements
that make them differ on purpose (combined triggers, no stale ranking, keep_newest) are checked against an
uninterrupted ``OrtCheckpoint`` run instead.

Setup: a linear model with a StepLR schedule, 8 samples in batches of 2 (4 steps per epoch), no shuffling and no
dropout (so a resume at an epoch end is exact for both callbacks), one validation batch per epoch whose ``val_loss``
comes from ``VALS`` (improves, then worsens: EarlyStopping with patience 2 stops after epoch 5, at step 24).
A run is interrupted by an exception raised before the batch of step ``STOP``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt._restore._reading import is_ort_checkpoint, read_lightning_checkpoint

VALS = [3.0, 2.0, 2.5, 1.0, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0]
STOP = 10  # interrupted in epoch 2, after the epoch-1 save (step 8)
END = 24  # EarlyStopping ends every run here


@pytest.fixture(autouse=True)
def _restore_seed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.tensor(VALS[self.current_epoch]))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}


class Interrupted(Exception):
    pass


class Interrupt(pl.Callback):
    """Raise before the batch of global step ``at`` (once): a crash, as far as the checkpoints know."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if self.at is not None and trainer.global_step == self.at:
            self.at = None
            raise Interrupted


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))


def make_trainer(cls: type, directory: str, stop: int | None = None, *, companions: bool = True,
                 **kwargs: Any) -> pl.Trainer:
    """``cls`` with ``kwargs`` (ours only for OrtCheckpoint); with ``companions``, EarlyStopping,
    LearningRateMonitor and the interruption too."""
    if cls is ModelCheckpoint:
        kwargs = {k: v for k, v in kwargs.items() if k not in OURS_ONLY}
    pl.seed_everything(0, verbose=False)
    # EarlyStopping checks where the checkpoints are saved (a resume from a validation-end file runs that epoch's
    # end again, with no metrics: Lightning's own behaviour, ModelCheckpoint's as much as ours)
    stopper = EarlyStopping("val_loss", patience=2, check_on_train_epoch_end=kwargs.get("save_on_train_epoch_end"))
    callbacks = [cls(dirpath=directory, **kwargs), stopper, LearningRateMonitor(), Interrupt(stop)]
    return pl.Trainer(accelerator="cpu", devices=1, logger=CSVLogger(directory + "-logs"), max_epochs=len(VALS),
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=callbacks if companions else callbacks[:1])


def fit(trainer: pl.Trainer, model: Net | None = None, ckpt_path: str | None = None) -> Net:
    model = model or Net()
    try:
        trainer.fit(model, DataLoader(_data(), batch_size=2), DataLoader(_data(), batch_size=8), ckpt_path=ckpt_path)
    except Interrupted:
        pass
    return model


def run(cls: type, directory: str, how: str, **kwargs: Any) -> dict[str, Any]:
    """One scenario: ``full`` (uninterrupted), ``new-last`` (interrupted, then a new Trainer resumes "last"),
    ``same-last`` / ``same-best`` (interrupted, then a second fit on the same Trainer). Returns what is compared."""
    if how == "full":
        trainer = make_trainer(cls, directory, **kwargs)
        fit(trainer)
    else:
        trainer = make_trainer(cls, directory, stop=STOP, **kwargs)
        model = fit(trainer)
        assert trainer.global_step == STOP
        where, which = how.split("-")
        if where == "new":
            trainer, model = make_trainer(cls, directory, **kwargs), None
        fit(trainer, model, ckpt_path=which)
        assert trainer.ckpt_path is not None
    return observe(trainer, directory)


def observe(trainer: pl.Trainer, directory: str) -> dict[str, Any]:
    atomic.wait_for_cleanup()
    cb, stopper = trainer.checkpoint_callback, trainer.early_stopping_callback
    lr_monitors = [c for c in trainer.callbacks if isinstance(c, LearningRateMonitor)]
    assert cb is not None

    def rel(p: str) -> str:
        return os.path.relpath(p, directory) if p else p

    def val(t: Any) -> Any:
        return None if t is None else float(t)

    last = os.path.join(directory, "last.ckpt")
    return {
        "files": sorted(os.listdir(directory)),
        "callback": {"best_model_path": rel(cb.best_model_path), "best_model_score": val(cb.best_model_score),
                     "best_k_models": {rel(p): val(v) for p, v in cb.best_k_models.items()},
                     "kth_best_model_path": rel(cb.kth_best_model_path), "kth_value": val(cb.kth_value),
                     "current_score": val(cb.current_score), "last_model_path": rel(cb.last_model_path)},
        "global_step": trainer.global_step, "epoch": trainer.current_epoch,
        "fit_loop": trainer.fit_loop.state_dict(),
        "stored_loop": _load(last)["loops"] if os.path.exists(last) else None,
        "early_stopping": stopper and (stopper.wait_count, stopper.stopped_epoch, val(stopper.best_score)),
        "learning_rates": [{k: [float(v) for v in vs] for k, vs in m.lrs.items()} for m in lr_monitors],
        "weights": {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()},
    }


def _load(path: str) -> dict[str, Any]:
    return read_lightning_checkpoint(path) if is_ort_checkpoint(path) else torch.load(path, weights_only=False)


def assert_same(ours: dict[str, Any], theirs: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
    for key in theirs:
        if key in skip:
            continue
        if key == "weights":
            for name, value in theirs[key].items():
                assert torch.equal(ours[key][name], value), name
        else:
            assert ours[key] == theirs[key], key


OURS_ONLY = {"async_save", "keep_newest"}

# The configurations where OrtCheckpoint must do exactly what ModelCheckpoint does (files, state, loops, weights).
SAME = {
    "monitor-top2-last": dict(monitor="val_loss", save_top_k=2, save_last=True),  # saves at train epoch end
    "monitor-link": dict(monitor="val_loss", save_last="link"),
    "after-validation": dict(monitor="val_loss", save_top_k=2, save_last=True, save_on_train_epoch_end=False),
    "no-monitor": dict(save_top_k=-1, save_last=True),
    "async": dict(monitor="val_loss", save_top_k=2, save_last=True, async_save=True),  # ours in the background
}


@pytest.mark.parametrize(("config", "how"), [(c, h) for c in SAME for h in ("new-last", "same-last")]
                         + [("monitor-top2-last", "same-best")])
def test_resume_does_what_model_checkpoint_does(tmp_path: Any, config: str, how: str) -> None:
    kwargs = SAME[config]
    theirs = run(ModelCheckpoint, str(tmp_path / "mc"), how, **kwargs)
    ours = run(OrtCheckpoint, str(tmp_path / "ort"), how, **kwargs)
    assert_same(ours, theirs)
    assert not [f for f in ours["files"] if "-v1" in f]
    if config == "after-validation" and how != "new-last":
        # a second fit on the same Trainer from a file saved at validation end trains no further, in Lightning with
        # ModelCheckpoint as with us (docs/callback.md, "Resuming")
        assert ours["global_step"] == theirs["global_step"] == 8
        return
    # what the issue saw go wrong: training goes on to the end and EarlyStopping finds its metric
    assert ours["global_step"] == END and ours["early_stopping"][1] == 5
    if how != "same-best":  # epoch-end resume is exact: the same as the uninterrupted run, for both callbacks
        full = run(OrtCheckpoint, str(tmp_path / "full"), "full", **kwargs)
        assert_same(ours, full, skip=("learning_rates",))  # the monitor logs only what its own fit saw


def test_epoch_end_save_holds_model_checkpoints_loop_state(tmp_path: Any) -> None:
    """The file written at an epoch end (monitor set, save_on_train_epoch_end resolving True) holds the loop state
    ModelCheckpoint's holds: the epoch processed, its end hooks run (so a resume starts the next epoch)."""
    for cls in (ModelCheckpoint, OrtCheckpoint):
        fit(make_trainer(cls, str(tmp_path / cls.__name__), stop=STOP, monitor="val_loss", save_last=True))
    theirs = _load(str(tmp_path / "ModelCheckpoint" / "last.ckpt"))
    ours = _load(str(tmp_path / "OrtCheckpoint" / "last.ckpt"))
    assert ours["loops"] == theirs["loops"]
    assert ours["loops"]["fit_loop"]["epoch_progress"]["total"] == \
        {"ready": 2, "started": 2, "processed": 2, "completed": 1}
    assert ours["callbacks"][next(k for k in ours["callbacks"] if k.startswith("EarlyStopping"))] == \
        theirs["callbacks"][next(k for k in theirs["callbacks"] if k.startswith("EarlyStopping"))]


@pytest.mark.parametrize("which", ["last", "best"])
def test_second_fit_on_the_same_trainer_trains_on(tmp_path: Any, which: str) -> None:
    """The README's pattern, as the issue measured it: a fit of 5 epochs (step 20), then, with more epochs allowed,
    ``fit(ckpt_path="last" | "best")`` on the same Trainer trains on to step 40, as with ModelCheckpoint."""
    seen = {}
    for cls in (ModelCheckpoint, OrtCheckpoint):
        directory = str(tmp_path / cls.__name__)
        trainer = make_trainer(cls, directory, companions=False, monitor="val_loss", save_top_k=2, save_last=True)
        trainer.fit_loop.max_epochs = 5
        model = fit(trainer)
        assert trainer.global_step == 20
        trainer.fit_loop.max_epochs = 10
        fit(trainer, model, ckpt_path=which)
        assert trainer.global_step == 40
        seen[cls] = observe(trainer, directory)
    assert_same(seen[OrtCheckpoint], seen[ModelCheckpoint])


# Our improvements differ from ModelCheckpoint on purpose; a resume must still leave what the uninterrupted run does.
OURS = {
    "steps-and-monitor": dict(monitor="val_loss", save_top_k=2, save_last=True, every_n_train_steps=3),
    "keep-newest-link": dict(monitor="val_loss", save_top_k=2, save_last="link", every_n_train_steps=3,
                             keep_newest=2),
}


@pytest.mark.parametrize("config", list(OURS))
def test_resume_of_our_improvements_leaves_the_uninterrupted_files(tmp_path: Any, config: str) -> None:
    """Resumed from a mid-epoch file (step 9): files, ranking, loops, early stopping and weights as
    in the uninterrupted run (the data position: the batches after the save are the uninterrupted run's), where
    ModelCheckpoint's resume from the same step restarts the plain DataLoader at the start of its epoch."""
    kwargs = OURS[config]
    full = run(OrtCheckpoint, str(tmp_path / "full"), "full", **kwargs)
    resumed = run(OrtCheckpoint, str(tmp_path / "resumed"), "new-last", **kwargs)
    assert_same(resumed, full, skip=("learning_rates", "stored_loop"))  # the monitor logs only what it saw
    theirs = run(ModelCheckpoint, str(tmp_path / "mc"), "new-last", **kwargs)
    assert any(not torch.equal(theirs["weights"][k], v) for k, v in full["weights"].items())


def test_resume_from_model_checkpoint_files(tmp_path: Any) -> None:
    """A run started with ModelCheckpoint (torch files) and resumed with OrtCheckpoint in the same directory carries
    on ModelCheckpoint's ranking: the same files are kept (old torch files rotate out like our own) as in a run
    that used ModelCheckpoint throughout, and training is the same."""
    kwargs = dict(monitor="val_loss", save_top_k=2, save_last=True)
    theirs = run(ModelCheckpoint, str(tmp_path / "mc"), "full", **kwargs)
    directory = str(tmp_path / "mixed")
    fit(make_trainer(ModelCheckpoint, directory, stop=STOP, **kwargs))
    started = set(os.listdir(directory))
    assert started == {"epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"}
    trainer = make_trainer(OrtCheckpoint, directory, **kwargs)
    fit(trainer, ckpt_path="last")
    assert trainer.ckpt_path == os.path.join(directory, "last.ckpt")
    ours = observe(trainer, directory)
    assert_same(ours, theirs, skip=("learning_rates", "stored_loop"))
    for name in ours["files"]:  # every file left is ours now: the torch ones rotated out, last.ckpt was replaced
        assert is_ort_checkpoint(os.path.join(directory, name)), name
