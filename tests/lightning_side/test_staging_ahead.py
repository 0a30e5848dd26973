"""The staging memory of asynchronous saves is there before the first save (issue 34, point 3), for single files
(``_staging.Stager``, through the plugin) and sharded folders (``_dcp_staging.ShardStager``, through the plugin's
sharded path and ``OrtStorageWriter`` under ``dcp.async_save``): the first save allocates nothing new, and copies
into the memory allocated ahead. Memory stays at one staging copy: what a save does not take (allocated ahead for
other shapes, or the previous save's of names it lacks) is freed before the save allocates what it lacks. No timing:
which buffer a save uses is checked by identity, allocations by counting them.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import CheckpointContents, OrtCheckpoint, OrtCheckpointIO, load_checkpoint
from lightning_ort_ckpt._dcp import _dcp_staging
from lightning_ort_ckpt._saving import _staging
from lightning_ort_ckpt.dcp import OrtStorageReader, OrtStorageWriter

SAVE_STEP = 3


class Net(pl.LightningModule):
    """Parameters, a buffer (BatchNorm's running statistics) and AdamW's state: every kind of tensor a save stages."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)), batch_size=4)


class FirstSave(pl.Callback):
    """Before the first save: whether the stager is ready (and the writer thread started) and what it allocated
    ahead; from then on, every
    allocation a save makes (``Stager._allocate``, counted on this stager only); at the end, the first save's
    buffers. ``switch_at``: the step after which the plugin, made synchronous, is switched to ``async_save=True``."""

    def __init__(self, switch_at: int | None = None) -> None:
        self.switch_at = switch_at
        self.ready_before = False
        self.ahead: set[int] = set()
        self.allocated: list[int] = []  # per allocation a save made: how many buffers
        self.staged: dict[str, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        io = trainer.strategy.checkpoint_io
        if trainer.global_step == self.switch_at:
            io.async_save = True
        if trainer.global_step != SAVE_STEP - 1:
            return
        stager = io._executors[True]._stager
        stager._memory.join()
        self.ready_before = stager.ready() and io._executors[True]._queue is not None  # the writer thread too
        self.ahead = {t.data_ptr() for ts in stager._memory.spares.values() for t in ts}
        allocate = stager._memory.allocate

        def counted(specs: list[Any], touch: bool) -> list[torch.Tensor]:
            self.allocated.append(len(specs))
            return allocate(specs, touch)

        stager._memory.allocate = counted

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        stager = trainer.strategy.checkpoint_io._executors[True]._stager
        self.staged = {name: t.data_ptr() for name, (_, t) in stager._memory.buffers.items()}


def fit_with(tmp_path: Path, io: OrtCheckpointIO, record: FirstSave, steps: int = SAVE_STEP) -> Net:
    pl.seed_everything(0, verbose=False)
    module = Net()
    callback = OrtCheckpoint(tmp_path, every_n_train_steps=SAVE_STEP, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(max_steps=steps, callbacks=[record, callback], plugins=[io], accelerator="cpu", devices=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data())
    return module


@pytest.mark.parametrize("switched", [False, True], ids=["async-from-the-start", "switched-to-async"])
def test_the_first_asynchronous_save_copies_into_memory_allocated_ahead(tmp_path: Path, switched: bool) -> None:
    """Made with ``async_save=True``, or made synchronous and switched before the first save: after the first
    optimizer step the staging memory of every tensor the save stages (parameters, BatchNorm's buffers, AdamW's
    moments and steps) exists; the first save copies all of it into that memory, and allocates only for the few
    bytes of Lightning's own entries (random states, the callback's state), whose shapes no step hook can see."""
    record = FirstSave(switch_at=1 if switched else None)
    module = fit_with(tmp_path, OrtCheckpointIO(async_save=not switched), record)
    assert record.ready_before
    lightning = [n for n in record.staged if n.startswith("lightning:")]
    assert len(record.staged) - len(lightning) == 6 + 3 + 6 * 3  # 6 parameters, 3 buffers, AdamW's step, 2 moments
    assert len(record.ahead) >= len(record.staged) - len(lightning)
    # memory is taken by shape and type: a 0-d entry of Lightning's may take a 0-d step's, which then gets a new one
    unprepared = [n for n, ptr in record.staged.items() if ptr not in record.ahead]
    assert len(unprepared) == len(lightning) > 0
    assert record.allocated == [len(lightning)]  # one allocation, as many buffers as Lightning's entries
    ck = load_checkpoint(tmp_path / f"step={SAVE_STEP}.ckpt")
    for name, p in module.named_parameters():
        assert torch.equal(torch.as_tensor(ck.trainable[name]), p.detach()), name


def _contents(**tensors: torch.Tensor) -> CheckpointContents:
    return CheckpointContents(trainable=dict(tensors))


def _an_unused_spare(stager: Any, spec: Callable[[torch.Tensor], Any]) -> weakref.ref[torch.Tensor]:
    """Give ``stager`` one buffer allocated ahead for a shape no save here has; only a weak reference stays."""
    unused = torch.zeros(1000)
    stager._memory.spares = {spec(unused): [unused]}
    return weakref.ref(unused)


def test_a_save_of_other_shapes_frees_what_it_does_not_take_before_allocating() -> None:
    """One staging copy at a time when the state changes shape: the memory allocated ahead for shapes the save does
    not have, and the previous save's buffers of names it lacks (once the previous save is written: the save waits
    for it), are gone when the save allocates its new buffers."""
    stager = _staging.Stager()
    gone = _an_unused_spare(stager, _staging._spec)
    seen: list[bool] = []
    waits: list[str] = []
    allocate = stager._memory.allocate

    def allocating(specs: list[Any], touch: bool) -> list[torch.Tensor]:
        gc.collect()
        seen.append(gone() is None)
        return allocate(specs, touch)

    stager._memory.allocate = allocating
    try:
        staged, job = stager.stage(_contents(a=torch.ones(7)), "first", [], [], lambda: waits.append("first"))
        job()
        assert seen == [True] and waits == []  # nothing to wait for: no earlier save
        assert torch.equal(torch.as_tensor(staged.trainable["a"]), torch.ones(7))
        old = weakref.ref(stager._memory.buffers["a"][1])
        del staged
        staged, job = stager.stage(_contents(b=torch.full((5,), 2.0)), "second", [], [],
                                   lambda: waits.append("second"))
        job()
        gone = old
        assert waits == ["second"] and seen[-1] is True  # waited for the first save, then freed its buffer
        assert torch.equal(torch.as_tensor(staged.trainable["b"]), torch.full((5,), 2.0))
    finally:
        stager.close()


# -- sharded --------------------------------------------------------------------------------------------------------
def test_shard_staging_is_allocated_ahead_only_while_saves_are_asynchronous() -> None:
    """The plugin's sharded path prepares its stager whatever the setting; memory is allocated after the first
    optimizer step taken while saves are asynchronous (``sources`` is None until then), for the module's
    parameters and buffers and the optimizer's state, and the stager says it is ready."""
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    asynchronous = False
    stager = _dcp_staging.ShardStager()
    stager.prepare(lambda: ([*model.parameters(), *model.buffers()], [opt]) if asynchronous else None)
    stager.arm([opt])  # the fit's optimizers exist (the plugin arms it when Lightning sets up the training data)

    def step() -> None:
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        stager._memory.join()

    try:
        step()
        assert not stager.ready() and stager._memory.spares == {}  # synchronous: nothing allocated
        asynchronous = True
        step()
        assert stager.ready()
        ahead = [t for ts in stager._memory.spares.values() for t in ts]
        assert len(ahead) == 4 + 3 + 4 * 3  # weight, bias, BatchNorm's 2 + 2 parameters, 3 buffers; Adam's 3 each
        flat = {f"model.{k}": v for k, v in model.state_dict().items()}
        flat.update({f"optim.{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()})
        staged = stager.stage(flat)
        assert {t.data_ptr() for t in staged.values()} <= {t.data_ptr() for t in ahead}
        assert all(torch.equal(staged[k], v) for k, v in flat.items())
    finally:
        stager.close()


def test_shard_staging_frees_what_a_save_does_not_take_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    stager = _dcp_staging.ShardStager()
    gone = _an_unused_spare(stager, _dcp_staging._spec)
    seen: list[bool] = []
    new = _dcp_staging._new

    def allocating(spec: Any, touch: bool) -> torch.Tensor:
        gc.collect()
        seen.append(gone() is None)
        return new(spec, touch)

    monkeypatch.setattr(_dcp_staging, "_new", allocating)
    first = stager.stage({"a": torch.ones(7)})
    gone = weakref.ref(first["a"])
    del first
    second = stager.stage({"b": torch.full((5,), 2.0)})
    assert seen == [True, True] and torch.equal(second["b"], torch.full((5,), 2.0))
    stager.close()


def test_dcp_async_save_copies_into_memory_our_writer_allocated_ahead(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``OrtStorageWriter.allocate_staging(state)`` before the first ``dcp.async_save``: that save allocates
    nothing and copies into the memory allocated for each key; the checkpoint loads back exactly."""
    state = {"model": {"w": torch.randn(32, 8), "b": torch.randn(8)}, "step": torch.tensor(3), "epoch": 1}
    writer = OrtStorageWriter(tmp_path / "a")
    writer.allocate_staging(state)
    writer._stager._memory.join()
    assert writer._stager.ready()
    ahead = {k: t.data_ptr() for k, (_, t) in writer._stager._memory.buffers.items()}
    assert len(ahead) == 3
    allocations: list[Any] = []
    new = _dcp_staging._new
    monkeypatch.setattr(_dcp_staging, "_new", lambda spec, touch: allocations.append(spec) or new(spec, touch))
    future = dcp.async_save(state, storage_writer=writer)
    expected = {"model": {k: v.clone() for k, v in state["model"].items()}, "step": state["step"].clone()}
    state["model"]["w"].add_(1)  # training goes on: the save holds the values of its call
    future.result()
    assert allocations == []
    assert {k: t.data_ptr() for k, (_, t) in writer._stager._memory.buffers.items()} == ahead
    writer.close()
    loaded = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}, "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=OrtStorageReader(tmp_path / "a"))
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected["model"].items())
    assert torch.equal(loaded["step"], expected["step"])


@pytest.mark.parametrize("layout", ["module", "shards"])
def test_the_step_hook_that_starts_the_allocation_never_removes_itself(layout: str) -> None:
    """torch iterates over an optimizer's post-hooks while it calls them: the hook that starts the allocation must
    not remove itself from under that loop (a hook registered after it would make the step raise). It sits on the
    fit's optimizer, never in torch's global registry; it does nothing once it has started; the first save removes
    it, and a hook registered after it ran at every step."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    model = nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    stager = _staging.Stager() if layout == "module" else _dcp_staging.ShardStager()
    before = dict(_global_optimizer_post_hooks)
    stager.prepare(lambda: (list(model.parameters()), [opt]))
    assert not opt._optimizer_step_post_hooks  # prepared: nothing registered yet
    stager.arm([opt])
    later: list[int] = []
    other = opt.register_step_post_hook(lambda *_: later.append(1))
    try:
        for _ in range(2):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()  # the first step starts the allocation; the second finds the hook idle
        stager._memory.join()
        assert later == [1, 1] and stager.ready()
        assert len(opt._optimizer_step_post_hooks) == 2  # ours (idle) and the later one
        assert dict(_global_optimizer_post_hooks) == before
        if layout == "module":
            stager.stage(_contents(w=model.weight.detach()), "x", [], [], lambda: None)[1]()
        else:
            stager.stage({"w": model.weight.detach()})
        assert list(opt._optimizer_step_post_hooks) == [other.id]  # the save removed ours
    finally:
        other.remove()
        stager.close()
    assert not opt._optimizer_step_post_hooks and dict(_global_optimizer_post_hooks) == before
