"""Asynchronous saves overlapping training (issue 22): the file holds the values of its step while the next steps run.

The copy is made slow deterministically, without timing: the test puts a wait on an Event it controls in the
plugin's writer queue before the save, so the deferred copy cannot be made until the test says so. Training runs the
next forward and backward pass meanwhile; the test checks that the optimizer step is then blocked in the staging
wait (its update not made), releases the writer, and reads the file: it holds the save step's parameters and
optimizer state, not the later ones. Covered: bfloat16 and float16 parameters, fused and foreach AdamW, gradient
accumulation, and two optimizers (a step waits for the copies of its own tensors only); a save to a memory file
system, written from the live tensors (the step waits for the write). The staging memory is allocated ahead of the
first save and freed at teardown. The CUDA branch's order of operations (side stream, one
event per tensor, the step's stream waiting for its own tensors' events, the writer synchronizing) runs on CPU with
stand-ins for torch.cuda's streams and events. The tests marked ``cuda`` run on a GPU (the copy then runs on a side
stream and the step waits on the GPU, not on the CPU) and are skipped only where there is none.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import CheckpointContents, OrtCheckpoint, OrtCheckpointIO, load_checkpoint
from lightning_ort_ckpt._saving import _staging as staging

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SAVE_STEP = 2
LIMIT = 120  # seconds: only a guard against a hang, never reached when the code is right


class Net(pl.LightningModule):
    def __init__(self, dtype: torch.dtype = torch.float32, optimizer: str = "foreach") -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)).to(dtype)
        self.optimizer = optimizer
        self.forward_after_save = threading.Event()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == SAVE_STEP:  # the step after the save: its forward and backward overlap the copy
            self.forward_after_save.set()
        x, y = batch
        out = self.body(x.to(self.body[0].weight.dtype))
        return nn.functional.mse_loss(out.float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-3, **{self.optimizer: True})  # eps: float16 range


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(48, 16, generator=g), torch.randn(48, 16, generator=g)), batch_size=4)


def snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and AdamW state, by the names an ORT file gives them (``group0/<param>/momentum0``...)."""
    out = {n: p.detach().cpu().clone() for n, p in module.named_parameters()}
    names = {p: n for n, p in module.named_parameters()}
    for p, state in optimizer.state.items():
        for key, ort in (("exp_avg", "momentum0"), ("exp_avg_sq", "momentum1")):
            out[f"group0/{names[p]}/{ort}"] = state[key].detach().cpu().clone()
    return out


def stored(path: Path) -> dict[str, torch.Tensor]:
    ck = load_checkpoint(path)
    out = dict(ck.trainable)
    for g, grp in ck.optimizer_groups.items():
        out.update({f"{g}/{p}/{m}": t for p, ms in grp.states.items() for m, t in ms.items() if m != "step"})
    return out


def blocked_in_staging_wait(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside the optimizer step's wait for a staging copy (read from its live stack)."""
    frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
    while frame is not None:
        if frame.f_code is staging.Stager._wait_for_copies.__code__:
            return True
        frame = frame.f_back
    return False


class GateWriter(pl.Callback):
    """At the save step, before ``OrtCheckpoint`` saves (Lightning runs checkpoint callbacks last), queues a wait on
    ``gate`` in the plugin's writer thread and records the state being saved; a second thread then waits until the
    training thread is blocked in the next optimizer step's staging wait, checks that no update was made, and opens
    the gate."""

    def __init__(self, expect_block: bool = True) -> None:
        self.gate = threading.Event()
        self.expect_block = expect_block
        self.stepped = threading.Event()  # the step after the save ended while the writer was still blocked
        self.expected: dict[str, torch.Tensor] = {}
        self.seen: dict[str, Any] = {}
        self._releaser: threading.Thread | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        if trainer.global_step == SAVE_STEP + 1 and not self.gate.is_set():
            self.stepped.set()
        if trainer.global_step != SAVE_STEP or self.expected:
            return
        trainer.strategy.checkpoint_io._executor.run(self.gate.wait)
        self.expected = snapshot(module, trainer.optimizers[0])
        self._releaser = threading.Thread(target=self._release, args=(threading.current_thread(), module),
                                          daemon=True)
        self._releaser.start()

    def _release(self, training: threading.Thread, module: Any) -> None:
        try:
            self.seen["forward ran"] = module.forward_after_save.wait(LIMIT)
            if self.expect_block:
                for _ in range(LIMIT * 1000):  # until the training thread is in the wait (bounded, not timed)
                    if blocked_in_staging_wait(training):
                        break
                    threading.Event().wait(0.001)
                self.seen["blocked"] = blocked_in_staging_wait(training)
                current = {n: p.detach().cpu() for n, p in module.named_parameters()}
                self.seen["unchanged while blocked"] = all(torch.equal(current[n], self.expected[n]) for n in current)
            else:  # the step must not wait for the writer: it ends while the writer is blocked
                self.seen["stepped while the writer was blocked"] = self.stepped.wait(LIMIT)
        finally:
            self.gate.set()

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        self.gate.set()  # never leave the writer blocked
        if self._releaser is not None:
            self._releaser.join()


def gated_fit(tmp_path: Path, module: Net, device: str = "cpu", expect_block: bool = True,
              more: tuple[pl.Callback, ...] = (), **trainer_kwargs: Any) -> tuple[GateWriter, OrtCheckpointIO, Path]:
    pl.seed_everything(0, verbose=False)
    gate = GateWriter(expect_block)
    io = OrtCheckpointIO(async_save=True)
    # the gated save is the first: it copies into memory allocated ahead, so it waits for no earlier save (which
    # would wait for the gate)
    callback = OrtCheckpoint(tmp_path, every_n_train_steps=SAVE_STEP, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(max_steps=5, callbacks=[gate, *more, callback], plugins=[io], accelerator=device, devices=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs)
    trainer.fit(module, data())
    return gate, io, tmp_path / f"step={SAVE_STEP}.ckpt"


def assert_holds_save_step(gate: GateWriter, path: Path, module: nn.Module) -> None:
    saved = stored(path)
    assert gate.expected.keys() <= saved.keys() and len(gate.expected) == 12  # 4 parameters, 2 AdamW moments each
    for name, value in gate.expected.items():
        assert saved[name].dtype == value.dtype, name
        assert torch.equal(saved[name], value), name
    later = {n: p.detach().cpu() for n, p in module.named_parameters()}
    assert not any(torch.equal(later[n], gate.expected[n]) for n in later)  # training did move on


@pytest.mark.parametrize("dtype, optimizer", [(torch.float32, "foreach"), (torch.bfloat16, "fused"),
                                              (torch.float16, "foreach"), (torch.bfloat16, "foreach"),
                                              (torch.float32, "fused")])
def test_file_holds_the_save_step_while_the_next_step_waits(tmp_path: Path, dtype: torch.dtype,
                                                             optimizer: str) -> None:
    module = Net(dtype, optimizer)
    gate, _, path = gated_fit(tmp_path, module)
    assert gate.seen == {"forward ran": True, "blocked": True, "unchanged while blocked": True}
    assert_holds_save_step(gate, path, module)


@pytest.mark.parametrize("dtype, optimizer", [(torch.float32, "foreach"), (torch.bfloat16, "fused")])
def test_a_save_to_memory_is_written_from_the_live_tensors_while_the_next_step_waits(
        memory_folder: Path, dtype: torch.dtype, optimizer: str) -> None:
    """On a memory file system the save writes the parameters and the optimizer's state from where they are (no
    staging copy of them, no memory for one): the next step waits for the write, and the file holds the save step."""
    module = Net(dtype, optimizer)
    staged = Counts()
    gate, io, path = gated_fit(memory_folder, module, more=(staged,))
    assert gate.seen == {"forward ran": True, "blocked": True, "unchanged while blocked": True}
    assert_holds_save_step(gate, path, module)
    names = {n for n, _ in module.named_parameters()}
    assert staged.staged and not [n for n in staged.staged if n in names or "/momentum" in n]  # Lightning's only


def test_gradient_accumulation(tmp_path: Path) -> None:
    """With two batches per optimizer step, the step that waits comes after two forward and backward passes."""
    module = Net(torch.bfloat16, "fused")
    gate, _, path = gated_fit(tmp_path, module, accumulate_grad_batches=2)
    assert gate.seen == {"forward ran": True, "blocked": True, "unchanged while blocked": True}
    assert_holds_save_step(gate, path, module)


def test_a_step_waits_only_for_its_own_optimizers_copies() -> None:
    """Two optimizers, each with a save pending: the one whose copy is made steps; the other waits for its own."""
    torch.manual_seed(0)
    models = [nn.Linear(8, 8), nn.Linear(8, 8)]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, foreach=True) for m in models]
    for m, o in zip(models, opts):  # AdamW's state exists from the first step on
        m(torch.ones(2, 8)).sum().backward()
        o.step()
    before = [m.weight.detach().clone() for m in models]
    stagers = [staging.Stager(), staging.Stager()]  # as two plugins would
    jobs = []
    for i, (m, o, stager) in enumerate(zip(models, opts, stagers)):
        ck = CheckpointContents(trainable={"w": m.weight.detach()},
                                frozen={"exp_avg": o.state[m.weight]["exp_avg"]})
        jobs.append(stager.stage(ck, f"{i}.ckpt", staging.optimizer_tensors([o]), [], lambda: None, optimizers=[o]))
    try:
        jobs[1][1]()  # the second save's copy is made; the first one's is not
        steps = threading.Thread(target=opts[1].step)
        steps.start()
        steps.join(LIMIT)
        assert not steps.is_alive() and not jobs[0][1].done.is_set()  # it stepped while the other copy pended
        assert not torch.equal(models[1].weight.detach(), before[1])
        first = threading.Thread(target=opts[0].step)
        first.start()
        for _ in range(LIMIT * 1000):
            if blocked_in_staging_wait(first):
                break
            threading.Event().wait(0.001)
        assert blocked_in_staging_wait(first) and torch.equal(models[0].weight.detach(), before[0])
        jobs[0][1]()
        first.join(LIMIT)
        assert not first.is_alive() and not torch.equal(models[0].weight.detach(), before[0])
        for (staged, _), b in zip(jobs, before):
            assert torch.equal(staged.trainable["w"], b)
    finally:
        for (_, job), stager in zip(jobs, stagers):
            job.skipped()
            stager.close()


class Counts(pl.Callback):
    """Records, at the first save, what the stager allocated ahead of it and what the save then staged into."""

    def __init__(self) -> None:
        self.spares: list[torch.Tensor] = []
        self.staged: dict[str, int] = {}  # the first save's buffers by name: their memory

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        stager = trainer.strategy.checkpoint_io._executors[True]._stager  # the asynchronous saves' stager
        if trainer.global_step == SAVE_STEP - 1:  # before the first save (after the first optimizer step)
            stager._memory.join()
            self.spares = [t for ts in stager._memory.spares.values() for t in ts]

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        stager = trainer.strategy.checkpoint_io._executors[True]._stager  # the asynchronous saves' stager
        self.staged = {name: t.data_ptr() for name, (_, t) in stager._memory.buffers.items()}


def test_staging_memory_is_allocated_ahead_and_freed_at_teardown(tmp_path: Path) -> None:
    """After the first optimizer step, before the first save, the buffers for the module's tensors and the
    optimizer's state exist (allocated on a thread); the save copies into them; teardown frees them and removes
    the step hooks."""
    pl.seed_everything(0, verbose=False)
    counts = Counts()
    io = OrtCheckpointIO(async_save=True)
    module = Net()
    callback = OrtCheckpoint(tmp_path, every_n_train_steps=SAVE_STEP, save_top_k=1, filename="{step}")
    trainer = pl.Trainer(max_steps=SAVE_STEP, callbacks=[counts, callback], plugins=[io], accelerator="cpu",
                         devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data())
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in module.parameters())  # + exp_avg, exp_avg_sq
    assert sum(t.numel() * t.element_size() for t in counts.spares) >= state_bytes
    state = [n for n in counts.staged if n in dict(module.named_parameters()) or "/momentum" in n]
    assert len(state) == 12  # 4 parameters, 2 AdamW moments each: the save copied them into the memory made ahead
    assert {counts.staged[n] for n in state} <= {t.data_ptr() for t in counts.spares}
    stager = io._executor._stager
    assert stager._memory.buffers == {} and stager._memory.spares == {} and stager._memory._hooks == []
    assert not stager._hooked
    assert stored(tmp_path / f"step={SAVE_STEP}.ckpt").keys() >= {n for n, _ in module.named_parameters()}


def test_a_synchronous_plugin_allocates_nothing_ahead(tmp_path: Path) -> None:
    counts = Counts()
    io = OrtCheckpointIO()
    trainer = pl.Trainer(max_steps=SAVE_STEP, callbacks=[counts, OrtCheckpoint(tmp_path)], plugins=[io],
                         accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Net(), data())
    assert counts.spares == [] and io._executors[True]._stager._memory._hooks == []


class _StandInStream:
    """Records what the staging code asks of a CUDA stream or event (for the plumbing test below)."""

    def __init__(self, log: list[tuple[str, Any]], device: Any = None) -> None:
        self.log, self.device = log, device

    def wait_stream(self, other: Any) -> None:
        self.log.append(("stream waits for the training stream", None))

    def wait_event(self, event: Any) -> None:
        self.log.append(("training stream waits", event.name))


def test_cuda_path_order_of_operations_with_cpu_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch of staging, run on CPU with stand-ins for torch.cuda's streams and events (their order is the
    point, not their speed): the side stream waits for the training stream once, then each copy is enqueued and
    its event recorded at the save; a buffer (not deferred) makes the training stream wait at once; an optimizer
    step makes its stream wait for the events of its own tensors only, without blocking; the writer synchronizes
    every event and finds no torn tensor (the step's own update does not count); close unpins the block."""
    log: list[tuple[str, Any]] = []
    order = ["a", "b", "running"]  # the checkpoint's tensors, in the order staging copies them
    created: list[Any] = []

    class Event:
        def __init__(self) -> None:
            self.name = order[len(created)]
            created.append(self)

        def record(self, stream: Any) -> None:
            log.append(("record", self.name))

        def synchronize(self) -> None:
            log.append(("writer synchronizes", self.name))

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _StandInStream(log, device))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _StandInStream(log, device))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(staging, "_spec", lambda t: (tuple(t.shape), t.dtype, True))
    monkeypatch.setattr(staging, "_pin", lambda block: block[:block.numel() - 2 * staging._PAGE])
    monkeypatch.setattr(staging, "_unpin", lambda pages: log.append(("unpin", pages.numel())))
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    running = torch.zeros(4)
    ck = CheckpointContents(trainable={"a": a.weight.detach(), "b": b.weight.detach()}, frozen={"running": running})
    stager = staging.Stager()
    before = a.weight.detach().clone()
    staged, job = stager.stage(ck, "x.ckpt", staging.optimizer_tensors([opt_a, opt_b]), [running], lambda: None,
                                optimizers=[opt_a, opt_b])
    assert log == [("stream waits for the training stream", None), ("record", "a"), ("record", "b"),
                   ("record", "running"), ("training stream waits", "running")]
    del log[:]
    a(torch.ones(1, 4)).sum().backward()
    opt_a.step()  # returns without the writer having run: the wait is the stream's
    assert log == [("training stream waits", "a")]
    del log[:]
    job()
    assert ("writer synchronizes", "a") in log and ("writer synchronizes", "b") in log
    assert torch.equal(staged.trainable["a"], before)
    stager.close()
    assert log[-1][0] == "unpin"


# -- on a GPU ---------------------------------------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("dtype, optimizer", [(torch.bfloat16, "fused"), (torch.float16, "foreach"),
                                              (torch.float32, "foreach")])
def test_cuda_file_holds_the_save_step_and_the_step_does_not_block(tmp_path: Path, dtype: torch.dtype,
                                                                   optimizer: str) -> None:
    """On a GPU the copy is enqueued at the save on a side stream: the steps after it run while the writer is
    blocked (they wait on the GPU for the copy's events, never on the CPU for the writer), and the file holds the
    save step's values."""
    module = Net(dtype, optimizer)
    gate, io, path = gated_fit(tmp_path, module, device="cuda", expect_block=False)
    assert gate.seen == {"forward ran": True, "stepped while the writer was blocked": True}
    assert_holds_save_step(gate, path, module)


@cuda
def test_cuda_staging_memory_is_pinned_and_unpinned_at_teardown(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    counts = Counts()
    io = OrtCheckpointIO(async_save=True)
    trainer = pl.Trainer(max_steps=SAVE_STEP, callbacks=[counts, OrtCheckpoint(tmp_path, every_n_train_steps=SAVE_STEP)],
                         plugins=[io], accelerator="cuda", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = Net()
    trainer.fit(module, data())
    cuda_spares = [t for t in counts.spares if t.numel() > 1]
    assert cuda_spares and all(t.is_pinned() for t in cuda_spares)
    assert io._executor._stager._pinned == []
    assert not any(t.is_pinned() for t in cuda_spares)  # unregistered at teardown
    assert os.path.exists(tmp_path / f"epoch=0-step={SAVE_STEP}.ckpt")
