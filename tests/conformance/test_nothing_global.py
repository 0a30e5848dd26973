"""Nothing global (issue 40, point 1): every hook, wrap and registration of ours belongs to one Trainer (or Fabric, or
call) and is gone at its teardown, deterministically: the garbage collector is off in these tests, so nothing may
rely on it. A snapshot of the process state we could ever touch (Lightning's classes and module functions, compared
by identity; torch's global optimizer hook registries; the threads) is taken before a configuration is made, after
it is made (making one installs nothing), and after its fits and teardown; the three must be the same.

One exception is left, named in :data:`STILL_GLOBAL` (and ARCHITECTURE.md, "What is global"): the ``checkpoint_io``
setter of Lightning's base ``Strategy`` classes, wrapped while an ``OrtCheckpointIO`` made by the user exists, which
is how a plugin used alone (and Fabric's) learns its strategy; ``OrtCheckpoint``'s own plugin lets go of it at once. :func:`test_the_checkpoint_io_setter_is_still_wrapped` fails once
that is fixed, so that the exception goes too.
"""

from __future__ import annotations

import gc
import os
import resource
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import BindCheckpointIO, OrtCheckpoint, OrtCheckpointIO
from lightning_ort_ckpt.format._store import wait_for_cleanup
from helpers.snapshot import STILL_GLOBAL, differences, snapshot


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The garbage collector off: nothing of ours may wait for it to be released."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g)), batch_size=4, shuffle=True, generator=g)


def trainer(callbacks: list[Any], plugins: list[Any] | None = None, steps: int = 4) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, callbacks=callbacks, plugins=plugins, accelerator="cpu", devices=1,
                      logger=False, enable_progress_bar=False, enable_model_summary=False)


def _callback(where: str, async_save: bool = False) -> Callable[[], tuple[list[Any], list[Any]]]:
    return lambda: ([OrtCheckpoint(dirpath=where, every_n_train_steps=2, save_top_k=-1, async_save=async_save)], [])


def _bound(where: str) -> Callable[[], tuple[list[Any], list[Any]]]:
    return lambda: ([ModelCheckpoint(dirpath=where, every_n_train_steps=2, save_top_k=-1, save_last=True),
                     BindCheckpointIO()], [OrtCheckpointIO()])


def _alone(where: str) -> Callable[[], tuple[list[Any], list[Any]]]:
    return lambda: ([ModelCheckpoint(dirpath=where, every_n_train_steps=2, save_top_k=-1, save_last=True)],
                    [OrtCheckpointIO()])


CONFIGURATIONS = {
    "callback": lambda tmp: _callback(str(tmp)),
    "callback, async": lambda tmp: _callback(str(tmp), async_save=True),
    "callback, memory:// (last: a stand-in)": lambda tmp: _callback(f"memory://{tmp.name}-global"),
    "plugin + BindCheckpointIO": lambda tmp: _bound(str(tmp)),
    "plugin alone": lambda tmp: _alone(str(tmp)),
}


@pytest.mark.parametrize("configuration", sorted(CONFIGURATIONS))
def test_a_trainer_of_ours_leaves_the_process_as_it_found_it(configuration: str, tmp_path: Path,
                                                             no_collector: None) -> None:
    """Made (nothing installed), two fits (the second resumes from "last", through a stand-in on memory://) and
    their teardowns: the snapshot is the one taken before, but for :data:`STILL_GLOBAL` while a plugin the user made
    exists (the callback's own plugin lets go of it at once: the callback installs nothing at all)."""
    allowed = set() if configuration.startswith("callback") else STILL_GLOBAL
    before = snapshot()
    callbacks, plugins = CONFIGURATIONS[configuration](tmp_path)()
    assert differences(before, snapshot()) <= allowed  # making them installs nothing else
    first = trainer(callbacks, plugins)
    assert differences(before, snapshot()) <= allowed
    first.fit(Tiny(), data())
    wait_for_cleanup()
    assert differences(before, snapshot()) <= allowed
    callbacks, plugins = CONFIGURATIONS[configuration](tmp_path)()
    second = trainer(callbacks, plugins, steps=8)
    second.fit(Tiny(), data(), ckpt_path="last")
    wait_for_cleanup()
    assert second.global_step == 8 and second.ckpt_path is not None and "ort-ckpt-last-" not in str(second.ckpt_path)
    after = snapshot()
    assert differences(before, after) <= allowed, differences(before, after)
    for optimizer in first.optimizers + second.optimizers:  # nor a hook left on the fits' own optimizers
        assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    for trained in (first, second):  # nor a checkpointing wrap left on the strategy instance, nor a callback added
        # (its process_dataloader stays wrapped, on that instance only, while the plugin is bound to it: a plugin
        # used alone serves the strategy fit after fit, and sees each fit's loaders through it)
        wrapped = {"save_checkpoint", "load_checkpoint", "teardown"} & set(trained.strategy.__dict__)
        assert not wrapped, wrapped
        assert [type(c).__name__ for c in trained.callbacks].count("RestoreRandomStates") == 0


def test_fabric_leaves_the_process_as_it_found_it(tmp_path: Path, no_collector: None) -> None:
    """``Fabric(plugins=[OrtCheckpointIO()])``: a save and a load change nothing of the process but
    :data:`STILL_GLOBAL` while the plugin exists; the wrap of the strategy instance's save is gone at the plugin's
    teardown."""
    from lightning_fabric import Fabric

    before = snapshot()
    plugin = OrtCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    state = {"model": model, "optimizer": optimizer}
    assert fabric.load(tmp_path / "fabric.ckpt", state) == {"step": 1}
    assert "save_checkpoint" in fabric.strategy.__dict__  # watched, on that instance only
    plugin.teardown()
    assert "save_checkpoint" not in fabric.strategy.__dict__  # and no more after the plugin's teardown
    assert differences(before, snapshot()) <= STILL_GLOBAL


def test_the_checkpoint_io_setter_is_still_wrapped(no_collector: None) -> None:
    """The one exception left (issue 40, point 1a): while an ``OrtCheckpointIO`` exists, the ``checkpoint_io`` setter
    of Lightning's base strategy classes is wrapped. When this fails, the exception is gone: empty
    :data:`STILL_GLOBAL`."""
    before = snapshot()
    plugin = OrtCheckpointIO()
    assert differences(before, snapshot()) == {key for key in STILL_GLOBAL if before[key] is not None}
    del plugin


def test_twenty_fits_in_a_row_grow_nothing(tmp_path: Path) -> None:
    """20 fits of the callback in one process (async saves: a thread and staging memory each): no hook, thread or
    wrap is left, even while the callbacks may still exist, and the resident memory stays within a generous bound
    (no fit keeps its model alive)."""
    def one(index: int) -> pl.Trainer:
        fit = trainer([OrtCheckpoint(dirpath=tmp_path / str(index), every_n_train_steps=2, async_save=True)])
        fit.fit(Tiny(), data())
        return fit

    one(-1)  # Lightning's and torch's own first-use allocations
    wait_for_cleanup()
    gc.collect()
    before, rss = snapshot(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for index in range(20):
        fit = one(index)
        assert all(not o._optimizer_step_pre_hooks and not o._optimizer_step_post_hooks for o in fit.optimizers)
        del fit
    wait_for_cleanup()
    assert differences(before, snapshot()) == set()
    gc.collect()
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024  # KiB on Linux
    assert grown_mib < 200, grown_mib


def _plain_run(where: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Lightning alone: a fit with ModelCheckpoint, the file it saved (torch), and a resumed fit's weights."""
    pl.seed_everything(3, verbose=False)
    plain = trainer([ModelCheckpoint(dirpath=where, every_n_train_steps=2, save_top_k=-1)])
    plain.fit(Tiny(), data())
    saved = torch.load(where / "epoch=0-step=2.ckpt", weights_only=True)["state_dict"]
    pl.seed_everything(4, verbose=False)
    resumed_module = Tiny()
    trainer([ModelCheckpoint(dirpath=where / "resumed")], steps=6).fit(resumed_module, data(),
                                                                       ckpt_path=where / "epoch=0-step=2.ckpt")
    return saved, {k: v.detach().clone() for k, v in resumed_module.state_dict().items()}


def test_a_plain_trainer_beside_a_fit_of_ours_runs_as_without_the_package(tmp_path: Path) -> None:
    """Differential: while one of our Trainers is in the middle of its fit (its plugin bound, its stager armed, its
    loaders watched), a second Trainer with Lightning's ModelCheckpoint saves and loads exactly as it does with no
    object of ours in the process."""
    expected = _plain_run(tmp_path / "alone")
    seen: list[Any] = []

    class Beside(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 2 and not seen:
                seen.append(_plain_run(tmp_path / "beside"))

    ours = trainer([Beside(), OrtCheckpoint(dirpath=tmp_path / "ours", every_n_train_steps=1, async_save=True)])
    ours.fit(Tiny(), data())
    (got,) = seen
    for want, have in zip(expected, got):
        assert want.keys() == have.keys()
        assert all(torch.equal(want[k], have[k]) for k in want)
    assert os.path.exists(tmp_path / "ours" / "epoch=0-step=4.ckpt")
