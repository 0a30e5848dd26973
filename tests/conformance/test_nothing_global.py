"""Nothing global (issue 40, point 1): every hook, wrap and registration of ours belongs to one Trainer (or Fabric, or
call) and is gone at its teardown, deterministically: the garbage collector is off in these tests, so nothing may
rely on it. A snapshot of the process state we could ever touch (``helpers.snapshot``: Lightning's classes and module
functions, compared by identity; torch's global optimizer and module hook registries; threads, open files, ``atexit``
callbacks, live ``weakref.finalize`` callbacks, signal handlers, excepthooks) is taken before a configuration is made,
after it is made (making one installs nothing), and after its fits and teardown; the three must be the same. Also:
what is left after teardown and ``del`` for the collector (no object of ours on a reference cycle; one that nothing
of Lightning's holds is freed at its last reference), no fork handler, 50 fits in a row, and a plain Trainer beside
one of ours. The same snapshots in each rank of 2-rank runs: test_nothing_global_ranks.py.

One exception is left, deprecated, named in :data:`STILL_GLOBAL` (and ARCHITECTURE.md, "What is global"): the
``checkpoint_io`` setter of Lightning's base ``Strategy`` classes, wrapped from the moment the user makes an
``OrtCheckpointIO`` until it is bound (``OrtCheckpoint``, ``BindCheckpointIO``, ``plugin.bind``) or freed: it is how a
plugin used alone (and Fabric's, unbound) learns its strategy, with a ``FutureWarning``. A plugin bound explicitly
leaves the process as it found it; :func:`test_the_checkpoint_io_setter_is_still_wrapped` fails once the deprecated
wrap is gone (0.6), so that the exception goes too.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import sys
import warnings
import weakref
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
from helpers.snapshot import STILL_GLOBAL, cyclic_garbage, described, differences, ours_on_cycles, snapshot


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


class Wider(Tiny):
    """320 KiB of parameters (1 MiB with Adam's moments, as much again staged by an asynchronous save): a fit that
    stays alive shows in the resident memory."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1 << 14)


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
    is not bound (the callback's own plugin lets go of it at once: the callback installs nothing at all; a plugin
    that ``BindCheckpointIO`` binds lets go in ``setup``; only the plugin alone, deprecated, keeps it)."""
    allowed = set() if configuration.startswith("callback") else STILL_GLOBAL
    after_fits = STILL_GLOBAL if configuration == "plugin alone" else set()
    before = snapshot()
    callbacks, plugins = CONFIGURATIONS[configuration](tmp_path)()
    assert differences(before, snapshot()) <= allowed  # making them installs nothing else
    first = trainer(callbacks, plugins)
    assert differences(before, snapshot()) <= allowed
    first.fit(Tiny(), data())
    wait_for_cleanup()
    assert differences(before, snapshot()) <= after_fits
    callbacks, plugins = CONFIGURATIONS[configuration](tmp_path)()
    second = trainer(callbacks, plugins, steps=8)
    second.fit(Tiny(), data(), ckpt_path="last")
    wait_for_cleanup()
    assert second.global_step == 8 and second.ckpt_path is not None and "ort-ckpt-last-" not in str(second.ckpt_path)
    after = snapshot()
    assert differences(before, after) <= after_fits, described(before, after)
    for optimizer in first.optimizers + second.optimizers:  # nor a hook left on the fits' own optimizers
        assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    for trained in (first, second):  # nor a checkpointing wrap left on the strategy instance, nor a callback added
        # (its process_dataloader stays wrapped, on that instance only, while the plugin is bound to it: a plugin
        # used alone serves the strategy fit after fit, and sees each fit's loaders through it)
        wrapped = {"save_checkpoint", "load_checkpoint", "teardown"} & set(trained.strategy.__dict__)
        assert not wrapped, wrapped
        assert [type(c).__name__ for c in trained.callbacks].count("RestoreRandomStates") == 0


@pytest.mark.parametrize("bound", [False, True], ids=["unbound (deprecated)", "plugin.bind(fabric.strategy)"])
def test_fabric_leaves_the_process_as_it_found_it(bound: bool, tmp_path: Path, no_collector: None) -> None:
    """``Fabric(plugins=[OrtCheckpointIO()])``: a save and a load change nothing of the process; bound with
    ``plugin.bind(fabric.strategy)`` nothing at all and no warning, unbound (deprecated) :data:`STILL_GLOBAL` while
    the plugin exists and a ``FutureWarning`` at the first save. The wrap of the strategy instance's save is gone at
    the plugin's teardown."""
    from lightning_fabric import Fabric

    before = snapshot()
    plugin = OrtCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    if bound:
        plugin.bind(fabric.strategy)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    deprecated = [str(w.message) for w in caught if w.category is FutureWarning and "bind(" in str(w.message)]
    assert len(deprecated) == (0 if bound else 1), deprecated
    state = {"model": model, "optimizer": optimizer}
    assert fabric.load(tmp_path / "fabric.ckpt", state) == {"step": 1}
    assert "save_checkpoint" in fabric.strategy.__dict__  # watched, on that instance only
    assert differences(before, snapshot()) == (set() if bound else {k for k in STILL_GLOBAL if before[k] is not None})
    plugin.teardown()
    assert "save_checkpoint" not in fabric.strategy.__dict__  # and no more after the plugin's teardown
    assert differences(before, snapshot()) <= (set() if bound else STILL_GLOBAL)


@pytest.mark.parametrize("configuration", ["plugin alone", "plugin + BindCheckpointIO"])
def test_only_the_plugin_alone_warns_that_finding_its_strategy_is_deprecated(configuration: str,
                                                                             tmp_path: Path) -> None:
    """The plugin alone learns its strategy through the setter wrap: one ``FutureWarning`` per fit that saves,
    naming what to add; bound by ``BindCheckpointIO``, none."""
    callbacks, plugins = CONFIGURATIONS[configuration](tmp_path)()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(callbacks, plugins).fit(Tiny(), data())
    deprecated = [str(w.message) for w in caught if w.category is FutureWarning and "OrtCheckpointIO" in str(w.message)]
    assert len(deprecated) == (configuration == "plugin alone"), deprecated
    if deprecated:
        assert "BindCheckpointIO()" in deprecated[0] and "0.6" in deprecated[0] and len(deprecated[0]) < 400


def test_the_checkpoint_io_setter_is_still_wrapped(no_collector: None) -> None:
    """The one exception left (issue 40, point 1a), deprecated: while an ``OrtCheckpointIO`` exists unbound, the
    ``checkpoint_io`` setter of Lightning's base strategy classes is wrapped. When this fails, the exception is
    gone: empty :data:`STILL_GLOBAL`."""
    before = snapshot()
    plugin = OrtCheckpointIO()
    assert differences(before, snapshot()) == {key for key in STILL_GLOBAL if before[key] is not None}
    del plugin


def test_after_a_fit_the_setter_wrap_waits_for_the_collector(tmp_path: Path, no_collector: None) -> None:
    """A plugin made by the user (alone) holds :data:`STILL_GLOBAL` until it is freed; after a fit, Lightning's own
    reference cycles (the Trainer's, which hold its strategy, so the plugin) leave that to the collector: with the
    collector off the wrap stays after ``del``, and one collection ends it. Fails once the wrap no longer waits."""
    before = snapshot()
    callbacks, plugins = _alone(str(tmp_path))()
    trainer(callbacks, plugins).fit(Tiny(), data())
    del callbacks, plugins
    assert differences(before, snapshot()) == {key for key in STILL_GLOBAL if before[key] is not None}
    gc.collect()
    assert differences(before, snapshot()) == set()


def _lives(trained: pl.Trainer, module: pl.LightningModule, extra: list[Any]) -> dict[str, Any]:
    objects = {"trainer": trained, "strategy": trained.strategy, "module": module,
               "optimizer": trained.optimizers[0], **{type(o).__name__: o for o in extra}}
    return {name: weakref.ref(o) for name, o in objects.items()}


@pytest.mark.parametrize("configuration", [*sorted(CONFIGURATIONS), "plain ModelCheckpoint"])
def test_after_teardown_only_lightnings_cycles_keep_a_fit_alive(configuration: str, tmp_path: Path,
                                                                no_collector: None) -> None:
    """With the collector off, a fit and its teardown, then ``del``: Lightning's own reference cycles (the Trainer
    and its loops, the module's ``_trainer``, ``callback.log``, which Lightning sets to the module's ``log`` on every
    callback) keep the Trainer, strategy, module and optimizer alive, ours or not (the plain ``ModelCheckpoint``
    run: the same). No object of ours lies on a reference cycle at all (Lightning's ``callback.log`` left out): not
    one of its own, nor one through Lightning's objects (a strategy, a Trainer); and one collection frees all of it
    (nothing global holds any of it)."""
    if configuration == "plain ModelCheckpoint":
        callbacks, plugins = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)], []
    else:
        callbacks, plugins = CONFIGURATIONS[configuration](tmp_path)()
    module, trained = Tiny(), trainer(callbacks, plugins)
    trained.fit(module, data())
    wait_for_cleanup()
    lives = _lives(trained, module, callbacks + plugins)
    for attr in ("log", "log_dict"):  # Lightning's back-references to the module, on every callback
        [vars(callback).pop(attr, None) for callback in trained.callbacks]
    del trained, module, callbacks, plugins
    garbage = cyclic_garbage()
    on_cycles = ours_on_cycles(garbage)
    del garbage
    gc.collect()
    alive = [name for name, ref in lives.items() if ref() is not None]
    assert on_cycles == {}, (on_cycles, alive)
    assert alive == []


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_plugin_is_freed_at_its_last_reference_not_by_the_collector(async_save: bool, tmp_path: Path,
                                                                      no_collector: None) -> None:
    """Where nothing of Lightning's holds it: a plugin bound to a strategy it was not given to (its data position
    watched, its staging memory prepared), that saved (an asynchronous save: its writer thread, its staging memory)
    and was torn down, is freed with everything of ours it made the moment the last reference goes, the collector
    off; the strategy's ``process_dataloader`` is then Lightning's again in effect (the wrap watches nothing), and the
    strategy too is freed at its last reference."""
    from pytorch_lightning.strategies import SingleDeviceStrategy

    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    plugin = OrtCheckpointIO(async_save=async_save)
    plugin.bind(strategy)
    with pytest.warns(Warning):  # called outside a fit: every entry frozen, with a warning
        plugin.save_checkpoint({"state_dict": nn.Linear(4, 2).state_dict()}, tmp_path / "a.ckpt")
    plugin.teardown()
    executor = plugin._executors[True]
    ours = [plugin, executor, executor._stager, executor._stager._memory, plugin._train_start,
            plugin._train_start._data]
    refs = [weakref.ref(o) for o in ours]
    del ours, executor, plugin
    assert [type(r()).__name__ for r in refs if r() is not None] == []
    loader = DataLoader(TensorDataset(torch.zeros(2, 1)))
    assert strategy.process_dataloader(loader) is loader
    held = weakref.ref(strategy)
    del strategy  # nor does the wrap the strategy keeps put the strategy on a cycle: freed at its last reference
    assert held() is None


def test_no_fork_handler_of_ours_and_none_runs_in_a_child(tmp_path: Path) -> None:
    """``os.register_at_fork`` has no query: the package's source names it nowhere, and a child forked after a fit
    (async saves: threads, staging memory) runs no code of ours, neither at the fork (the profiler sees every Python
    call there) nor at its exit (its ``atexit`` callbacks: the parent's, inherited)."""
    import lightning_ort_ckpt

    package = Path(lightning_ort_ckpt.__file__).parent
    assert [p for p in package.rglob("*.py") if "register_at_fork" in p.read_text()] == []
    trained = trainer([OrtCheckpoint(dirpath=tmp_path, every_n_train_steps=2, async_save=True)])
    trained.fit(Tiny(), data())
    wait_for_cleanup()
    ran: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(str(package)):
            ran.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    read, write = os.pipe()
    sys.setprofile(profile)
    try:
        pid = os.fork()
        if pid == 0:  # the child: its atexit callbacks (the parent's), then say what of ours ran
            import atexit

            atexit._run_exitfuncs()
            os.write(write, repr(ran).encode())
            os._exit(0)
    finally:
        sys.setprofile(None)
    os.close(write)
    with os.fdopen(read) as reader:
        child = reader.read()
    assert os.waitpid(pid, 0)[1] == 0
    assert ran == [] and child == "[]", (ran, child)


def test_fifty_fits_in_a_row_grow_nothing(tmp_path: Path) -> None:
    """50 fits in one process, in turn the callback (async saves: a thread and staging memory each), the plugin +
    ``BindCheckpointIO`` and the plugin alone: after 10 warm-up fits, the next 40 leave the hooks, threads, files
    and everything else of the snapshot as they were, and the resident memory within 8 MiB (a fit of :class:`Wider`
    kept alive, its module, optimizer state or staging memory, adds 3-6 MiB: 40 of them, 120 MiB and more; the leak
    of issue 40 was 40-80 MiB a fit)."""
    kinds = [lambda i: _callback(str(tmp_path / str(i)), async_save=True)(), lambda i: _bound(str(tmp_path / str(i)))(),
             lambda i: _alone(str(tmp_path / str(i)))()]
    figures = []
    for index in range(50):
        fit = trainer(*kinds[index % 3](index))
        fit.fit(Wider(), data())
        assert all(not o._optimizer_step_pre_hooks and not o._optimizer_step_post_hooks for o in fit.optimizers)
        del fit
        if index >= 9:
            wait_for_cleanup()
            figures.append(_resident_mib())
        if index == 9:
            before = snapshot()
    assert differences(before, snapshot()) <= STILL_GLOBAL, described(before, snapshot())
    grown = [round(f - figures[0], 1) for f in figures[1:]]
    print(f"resident memory over the last 40 fits, MiB: {grown}")
    assert grown[-1] < 8, grown


def _resident_mib() -> float:
    """The resident memory after a collection, with the memory malloc holds free handed back to the system."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


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
