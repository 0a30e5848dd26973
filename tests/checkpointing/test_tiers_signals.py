"""The fast tier under the signals a scheduler sends, to real training processes (no mock).

* SIGTERM (spot machines, Kubernetes, SLURM's ``--signal``): Lightning raises ``SIGTERMException`` at the next batch
  boundary; the fast tier saves the current step there before the exit, without ``save_on_exception``, and
  ``fit(ckpt_path="last")`` resumes from it bit for bit.
* SIGUSR1 under ``SLURMEnvironment(auto_requeue=True)``, with a stand-in ``scontrol`` on ``PATH`` (the only fake):
  Lightning saves ``hpc_ckpt_1.ckpt`` through our plugin from inside its signal handler and requeues the job;
  "last" then takes the newest of the hpc file, the fast tier and ``dirpath``: the hpc file when the job is killed
  before the fast tier saved anything newer, the fast tier's step when training went on after it.
* SIGTERM in validation (the current step saved, exact), in a relaunch's sanity check (nothing to save: a clean
  exit, "last" resumes the step committed before), and while a background write is in progress (no deadlock; the
  step it stops at committed).
* A SIGUSR1 that lands inside one of our synchronous saves: the handler's save runs once that save returns; one
  that lands during a background write: the hpc save queues behind it, both durable before the requeue.
* Two DDP ranks under ``SLURMEnvironment``, launched as ``srun`` would (the SLURM variables of each task): SIGUSR1,
  then SIGTERM, to both; a relaunch resumes both ranks from the fast tier.

The children fork from ``tests/helpers/forkserver.py`` and train the model of ``tests/helpers/preemption.py`` on a
plain shuffled ``DataLoader``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import LocalTier, OrtCheckpoint, load_checkpoint
from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
from helpers import forkserver
from helpers.preemption import MAX_STEPS, Net
from helpers.signals import Waits, finish, interrupted_at, scontrol, until_both

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
WIDTH = 16
SIGNAL_SENT = "signal-sent"  # the file the parent creates once it sent a signal (in the fit's root)


def loader(width: int) -> DataLoader:
    """A plain shuffled loader: the data position in every checkpoint resumes it mid-epoch (``_data_position``)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, width, generator=g), torch.randn(24, width, generator=g))
    return DataLoader(data, batch_size=4, shuffle=True)


def make_callback(root: Path, every: int, async_save: bool) -> OrtCheckpoint:
    """Persistent saves every 100 steps (none in these fits): what "last" finds is the fast tier's or the hpc
    file."""
    return OrtCheckpoint(root / "persistent", every_n_train_steps=100, async_save=async_save,
                         local=LocalTier(root / "fast", every_n_train_steps=every, keep=2))


def make_trainer(root: Path, callbacks: list[pl.Callback], plugins: list[Any] = (),  # type: ignore[assignment]
                 sanity: int = 0) -> pl.Trainer:
    return pl.Trainer(max_steps=MAX_STEPS, callbacks=callbacks, plugins=list(plugins), accelerator="cpu", devices=1,
                      logger=False, enable_checkpointing=any(isinstance(c, OrtCheckpoint) for c in callbacks),
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=sanity,
                      val_check_interval=3, limit_val_batches=4, default_root_dir=root)


def child_fit(root: str, every: str, async_save: str, slurm: str, waits: str, ckpt_path: str = "",
              sanity: str = "0", slow: str = "") -> None:
    """A fit to ``MAX_STEPS`` (from ``ckpt_path`` if any, after ``sanity`` sanity-check batches); with ``slow``,
    the background write of the fast tier's file of that name waits for a signal (:class:`_SlowWrite`)."""
    plugins = []
    if slurm == "1":
        from pytorch_lightning.plugins.environments import SLURMEnvironment

        plugins.append(SLURMEnvironment(auto_requeue=True))
    steps = {int(k): v for k, v in (w.split(":") for w in waits.split(","))}
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(Path(root), [Waits(steps), make_callback(Path(root), int(every), async_save == "1")],
                           plugins, sanity=int(sanity))
    if slow:
        _SlowWrite.install(trainer, slow)
    trainer.fit(Net(WIDTH), loader(WIDTH), loader(WIDTH), ckpt_path=ckpt_path or None)
    print("finished", flush=True)


class _SlowWrite:
    """(In the child) the local store of the fast tier, whose write of one file pauses (on the background thread:
    ``async_save=True``) until the parent has sent its signal (the file ``SIGNAL_SENT`` it creates then): the signal
    lands during an asynchronous save. (Not until the signal was handled: Python runs a handler on the main thread
    only, which may be waiting for this very write, for a staging buffer or a requeue save to be durable.)"""

    @staticmethod
    def install(trainer: pl.Trainer, name: str) -> None:
        from lightning_ort_ckpt.format._local_store import LocalStore
        from lightning_ort_ckpt.format._store import register

        class SlowWrite(LocalStore):
            @classmethod
            def handles(cls, path: Any) -> bool:
                return path is not None and os.fspath(path).startswith(os.path.join(trainer.default_root_dir, "fast"))

            def writing(self, path: str, **kwargs: Any) -> Any:
                if os.path.basename(path) == name:  # (a line of its own, whatever the training thread prints)
                    os.write(sys.stdout.fileno(), f"\nwriting {name}\n".encode())
                    while not os.path.exists(os.path.join(trainer.default_root_dir, SIGNAL_SENT)):
                        time.sleep(0.01)
                return super().writing(path, **kwargs)

        register(SlowWrite)  # this child's own table of backends (a test-only store)


_CHILD = f"""
import sys
sys.path[:0] = [{TESTS_DIR!r}, {os.path.dirname(TESTS_DIR)!r}]  # this module, and helpers/
from test_tiers_signals import child_fit
child_fit(*sys.argv[1:])
"""


def run_child(root: Path, every: int, async_save: bool, waits: dict[int, str], signals: list[tuple[str, int]],
              slurm: bool = False, ckpt_path: str = "", sanity: int = 0, slow: str = "") -> str:
    """Start the child, send each signal of ``signals`` at the line that starts with its text; its output."""
    script = root / "train.py"
    script.write_text(textwrap.dedent(_CHILD))
    args = [str(root), str(every), str(int(async_save)), str(int(slurm)),
            ",".join(f"{k}:{v}" for k, v in waits.items()), ckpt_path, str(sanity), slow]
    proc = forkserver.spawn(script=str(script), args=args, cwd=str(root), merge_stderr=True)
    return forkserver.signalled(proc, signals, sent=(root / SIGNAL_SENT).touch)


def reference() -> dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    net = Net(WIDTH)
    pl.Trainer(max_steps=MAX_STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, val_check_interval=3,
               limit_val_batches=4).fit(net, loader(WIDTH), loader(WIDTH))
    return net.state_dict()


def resume(root: Path, every: int) -> pl.Trainer:
    """``fit(ckpt_path="last")`` in this process (no SLURM here), to the end."""
    trainer = make_trainer(root, [make_callback(root, every, False)])
    trainer.fit(Net(WIDTH), loader(WIDTH), loader(WIDTH), ckpt_path="last")
    return trainer


def assert_exact(trainer: pl.Trainer) -> None:
    expected, got = reference(), trainer.lightning_module.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigterm_commits_the_current_step_to_the_fast_tier(tmp_path: Path, async_save: bool) -> None:
    # the fast tier every 5 steps has nothing of step 3 but what the SIGTERM saves
    out = run_child(tmp_path, 5, async_save, {3: "sigterm"}, [("training 3", signal.SIGTERM)])
    step = interrupted_at(out)  # Lightning finishes the batch it is in, and raises at the next boundary
    assert step < 5 and "finished" not in out, out
    fast = tmp_path / "fast"
    assert sorted(os.listdir(fast)) == [f"step={step}.ckpt"], out  # committed, nothing half-written beside it
    load_checkpoint(fast / f"step={step}.ckpt")
    assert read_lightning_checkpoint(fast / f"step={step}.ckpt")["global_step"] == step
    trainer = resume(tmp_path, 5)
    assert trainer.ckpt_path == str(fast / f"step={step}.ckpt")
    assert_exact(trainer)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigterm_in_validation_commits_the_current_step(tmp_path: Path, async_save: bool) -> None:
    """SIGTERM during the validation after step 3: Lightning raises ``SIGTERMException`` after the validation batch
    it is in; the fast tier (every 5 steps) saves step 3, and "last" resumes from it bit for bit."""
    out = run_child(tmp_path, 5, async_save, {3: "val-sigterm"}, [("validating 3 1", signal.SIGTERM)])
    assert interrupted_at(out) == 3 and "finished" not in out and "training 3" not in out, out
    fast = tmp_path / "fast"
    assert sorted(os.listdir(fast)) == ["step=3.ckpt"], out
    assert read_lightning_checkpoint(fast / "step=3.ckpt")["global_step"] == 3
    trainer = resume(tmp_path, 5)
    assert trainer.ckpt_path == str(fast / "step=3.ckpt")
    assert_exact(trainer)


def test_sigterm_in_the_sanity_check_exits_cleanly(tmp_path: Path) -> None:
    """A fit stopped by SIGTERM at step 4 (the fast tier saves it), then a relaunch (without ``ckpt_path``) gets
    SIGTERM in its sanity check: there is nothing new to save (no training step ran), so nothing is written, the
    exit is clean, and "last" still resumes the step committed before, bit for bit."""
    out = run_child(tmp_path, 100, False, {4: "sigterm"}, [("training 4", signal.SIGTERM)])
    step = interrupted_at(out)
    fast = tmp_path / "fast"
    before = {n: (fast / n).stat().st_mtime_ns for n in os.listdir(fast)}
    assert list(before) == [f"step={step}.ckpt"], out
    # (Lightning runs no sanity check when it resumes: a relaunch that does not pass ckpt_path)
    again = run_child(tmp_path, 100, False, {0: "val-sigterm"}, [("validating 0 1", signal.SIGTERM)], sanity=3)
    assert interrupted_at(again) == 0 and "training" not in again, again  # (not after the last batch it checks)
    assert {n: (fast / n).stat().st_mtime_ns for n in os.listdir(fast)} == before, again
    assert not (tmp_path / "persistent").exists() or not os.listdir(tmp_path / "persistent"), again
    trainer = resume(tmp_path, 100)
    assert trainer.ckpt_path == str(fast / f"step={step}.ckpt")
    assert_exact(trainer)


@pytest.mark.parametrize("at", [3, 4])
def test_sigterm_during_an_async_save_commits_the_current_step(tmp_path: Path, at: int) -> None:
    """SIGTERM while the background write of step ``at``'s fast-tier file is in progress (held until the signal was
    sent): no deadlock; Lightning stops at the next batch boundary, and the step it stops at is committed (with
    the one before it: keep 2) and resumed from bit for bit. Step 3's file is saved before the validation that
    follows step 3, which the resumed fit runs (``_validation_resume``)."""
    out = run_child(tmp_path, 1, True, {99: "none"}, [(f"writing step={at}.ckpt", signal.SIGTERM)],
                    slow=f"step={at}.ckpt")
    step = interrupted_at(out)
    assert step in (at, at + 1) and "finished" not in out, out  # (the next save waits for this one's write)
    fast = tmp_path / "fast"
    assert sorted(os.listdir(fast)) == sorted([f"step={step - 1}.ckpt", f"step={step}.ckpt"]), out
    assert read_lightning_checkpoint(fast / f"step={step}.ckpt")["global_step"] == step
    trainer = resume(tmp_path, 1)
    assert trainer.ckpt_path == str(fast / f"step={step}.ckpt")
    assert_exact(trainer)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_slurm_requeue_then_kill_resumes_from_the_hpc_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           async_save: bool) -> None:
    """SIGUSR1 at step 4, then the job is killed (SIGKILL) while it waits at step 5: the fast tier (every 100 steps)
    holds nothing newer, so "last" is Lightning's ``hpc_ckpt_1.ckpt`` (written by our plugin, whole)."""
    with monkeypatch.context() as m:
        log = scontrol(tmp_path, m)
        out = run_child(tmp_path, 100, async_save, {4: "requeued", 5: "sigterm"},
                        [("training 4", signal.SIGUSR1), ("training 5", signal.SIGKILL)], slurm=True)
    assert log.read_text().split() == ["requeue", "4242"], out
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    load_checkpoint(hpc)
    assert read_lightning_checkpoint(hpc)["global_step"] == 4
    assert not os.listdir(tmp_path / "fast")
    trainer = resume(tmp_path, 100)
    assert trainer.ckpt_path == str(hpc)
    assert_exact(trainer)


def test_slurm_requeue_then_sigterm_resumes_from_the_newer_fast_step(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGUSR1 at step 4 (``hpc_ckpt_1.ckpt`` of step 4), training goes on, SIGTERM at step 7: the fast tier (every
    step) holds the step it stopped at, and "last" takes it, the newest."""
    with monkeypatch.context() as m:
        log = scontrol(tmp_path, m)
        out = run_child(tmp_path, 1, True, {4: "requeued", 7: "sigterm"},
                        [("training 4", signal.SIGUSR1), ("training 7", signal.SIGTERM)], slurm=True)
    step = interrupted_at(out)
    assert log.exists() and step > 4, out
    assert read_lightning_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")["global_step"] == 4
    assert sorted(os.listdir(tmp_path / "fast")) == [f"step={step - 1}.ckpt", f"step={step}.ckpt"]
    trainer = resume(tmp_path, 1)
    assert trainer.ckpt_path == str(tmp_path / "fast" / f"step={step}.ckpt")
    assert_exact(trainer)


def test_a_requeue_signal_during_an_async_save_saves_the_current_step(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGUSR1 while the background write of step 4's fast-tier file is in progress (held until the signal was
    sent), sent once the training thread is at the start of the next batch (a batch boundary, so that Lightning's
    save is of step 4 whole; sent as the writer began, on a loaded machine it landed in step 4's last hooks): the handler's save of ``hpc_ckpt_1.ckpt`` queues behind that
    write and waits for both to be durable (no deadlock: the queue is not the training thread's); training goes on
    to the end, and a fit from the hpc file ends where the uninterrupted one does, bit for bit."""
    with monkeypatch.context() as m:
        log = scontrol(tmp_path, m)
        out = run_child(tmp_path, 1, True, {4: "requeued"}, [("training 4", signal.SIGUSR1)], slurm=True,
                        slow="step=4.ckpt")
    assert "finished" in out and log.read_text().split() == ["requeue", "4242"], out
    assert "\nwriting step=4.ckpt\n" in out, out  # the write held until the signal was sent, then made
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    load_checkpoint(hpc)
    assert read_lightning_checkpoint(hpc)["global_step"] == 4
    trainer = make_trainer(tmp_path, [make_callback(tmp_path, 1, False)])
    trainer.fit(Net(WIDTH), loader(WIDTH), loader(WIDTH), ckpt_path=str(hpc))
    assert_exact(trainer)


_FIRST_IMPORT = f"""
import sys
sys.path[:0] = [{TESTS_DIR!r}, {os.path.dirname(TESTS_DIR)!r}]
import pytorch_lightning as pl
from pathlib import Path
from test_tiers_signals import Net, WIDTH, loader, make_callback, make_trainer

class Look(pl.Callback):
    def on_fit_start(self, trainer, pl_module):
        print("omegaconf before the first save:", "omegaconf" in sys.modules, flush=True)

print("omegaconf at start:", "omegaconf" in sys.modules, flush=True)
make_trainer(Path(sys.argv[1]), [Look(), make_callback(Path(sys.argv[1]), 100, False)]).fit(
    Net(WIDTH), loader(WIDTH), loader(WIDTH))
"""


def test_lightnings_first_save_imports_nothing_a_requeue_signal_can_land_in(tmp_path: Path) -> None:
    """Lightning's ``dump_checkpoint`` imports ``omegaconf`` at a process's first save; a requeue signal handled
    during that import saved inside it and failed (``ImportError`` of a half-initialized module: 4 of 50 SIGUSR1s in
    ``benchmarks/signals.py``). The plugin makes that import when it is bound, before any save."""
    proc = forkserver.spawn(code=_FIRST_IMPORT, args=[str(tmp_path)], cwd=str(tmp_path), merge_stderr=True)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "omegaconf at start: False" in out and "omegaconf before the first save: True" in out, out


class _SlowStore:
    """(In the child) the local store of ``default_root_dir``, whose write of step 4's file pauses (on the training
    thread: saves are synchronous) until the requeue signal was handled: the signal lands inside one of our saves."""

    @classmethod
    def make(cls) -> type:
        from lightning_ort_ckpt.format._local_store import LocalStore

        class SlowStore(LocalStore):
            @classmethod
            def handles(cls, path: Any) -> bool:
                return path is not None and os.fspath(path).startswith(os.environ["SLOW_ROOT"])

            def writing(self, path: str, **kwargs: Any) -> Any:
                if os.path.basename(path) == "epoch=0-step=4.ckpt":
                    print("writing epoch=0-step=4.ckpt", flush=True)
                    while not os.path.exists(os.environ["REQUEUE_LOG"]):
                        time.sleep(0.01)
                return super().writing(path, **kwargs)

        return SlowStore


def child_in_save(root: str) -> None:
    from pytorch_lightning.plugins.environments import SLURMEnvironment
    from lightning_ort_ckpt.format._store import register

    register(_SlowStore.make())  # this child's own table of backends (a test-only store)
    pl.seed_everything(0, verbose=False)
    callback = OrtCheckpoint(root, every_n_train_steps=4, save_top_k=-1)
    make_trainer(Path(root), [callback], [SLURMEnvironment(auto_requeue=True)]).fit(
        Net(WIDTH), loader(WIDTH), loader(WIDTH))
    print("finished", flush=True)


def test_a_requeue_signal_inside_a_save_saves_once_that_save_returns(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGUSR1 while the training thread is inside our synchronous save of step 4 into ``default_root_dir`` (the
    folder the hpc file goes to): the handler's save does not run inside the interrupted one (which may hold the
    folder's writer lock), but right after it returns; nothing hangs, and both files are whole."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{TESTS_DIR!r}, {os.path.dirname(TESTS_DIR)!r}]  # this module, and helpers/
        from test_tiers_signals import child_in_save
        child_in_save(sys.argv[1])
    """))
    with monkeypatch.context() as m:
        log = scontrol(tmp_path, m)
        m.setenv("SLOW_ROOT", str(tmp_path))
        proc = forkserver.spawn(script=str(script), args=[str(tmp_path)], cwd=str(tmp_path), merge_stderr=True)
    out = forkserver.signalled(proc, [("writing epoch=0-step=4.ckpt", signal.SIGUSR1)])
    assert proc.returncode == 0 and "finished" in out and log.exists(), out
    step_file, hpc = tmp_path / "epoch=0-step=4.ckpt", tmp_path / "hpc_ckpt_1.ckpt"
    load_checkpoint(step_file)
    load_checkpoint(hpc)
    assert read_lightning_checkpoint(hpc)["global_step"] == 4
    # the hpc file was written after the interrupted save had finished writing step 4's file
    assert hpc.stat().st_mtime_ns >= step_file.stat().st_mtime_ns


_RANKS = f"""
import json, os, sys, time
sys.path[:0] = [{TESTS_DIR!r}, {os.path.dirname(TESTS_DIR)!r}]  # this module, and helpers/
import pytorch_lightning as pl
from pathlib import Path
from pytorch_lightning.plugins.environments import SLURMEnvironment
from test_tiers_signals import Net, Waits, loader, make_callback, WIDTH

root, phase = Path(sys.argv[1]), sys.argv[2]


class Record(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        with open(root / f"{{phase}}.rank{{trainer.global_rank}}.json", "w") as f:
            json.dump({{"start": trainer.global_step, "ckpt_path": trainer.ckpt_path and str(trainer.ckpt_path)}}, f)


pl.seed_everything(0, verbose=False)
callbacks = [Waits({{4: "requeued", 6: "sigterm"}}) if phase == "first" else Record(), make_callback(root, 5, True)]
trainer = pl.Trainer(max_steps=12, accelerator="cpu", devices=2, num_nodes=1, strategy="ddp", logger=False,
                     callbacks=callbacks, plugins=[SLURMEnvironment(auto_requeue=True)], default_root_dir=root,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=0)
trainer.fit(Net(WIDTH), loader(WIDTH), ckpt_path=None if phase == "first" else "last")
print("finished", flush=True)
"""


def _start_ranks(tmp_path: Path, phase: str, env: dict[str, str]) -> list[Any]:
    import subprocess

    from helpers.launching import free_port

    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(_RANKS))
    common = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "SLURM_NTASKS": "2",
              "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "PYTHONWARNINGS": "ignore"}
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "PL_GLOBAL_SEED"):
        common.pop(name, None)
    return [subprocess.Popen([sys.executable, str(script), str(tmp_path), phase], cwd=str(tmp_path), text=True,
                             env={**common, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]


def test_two_ranks_requeue_then_sigterm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 DDP ranks under ``SLURMEnvironment`` (gloo, async saves, the fast tier every 5 steps): SIGUSR1 to both at
    step 4 (``hpc_ckpt_1.ckpt``, written by rank 0, every rank in its barrier), SIGTERM to both at step 6 (the fast
    tier saves step 6 or 7, where Lightning stops); a relaunch with ``ckpt_path="last"`` resumes both ranks from
    the fast tier, the newest. Nothing hangs."""
    with monkeypatch.context() as m:
        log = scontrol(tmp_path, m)
        env = dict(os.environ)
    procs, out = _start_ranks(tmp_path, "first", env), [[], []]
    try:
        until_both(procs, "training 4", out)
        for p in procs:
            p.send_signal(signal.SIGUSR1)
        until_both(procs, "training 6", out)
        for p in procs:
            p.send_signal(signal.SIGTERM)
    finally:
        finish(procs, out)
    text = "".join(out[0] + out[1])
    assert log.read_text().split() == ["requeue", "4242"], text
    assert read_lightning_checkpoint(tmp_path / "hpc_ckpt_1.ckpt")["global_step"] == 4
    stopped = {interrupted_at("".join(o)) for o in out}
    assert len(stopped) == 1 and stopped.pop() in (6, 7), text
    newest = sorted(os.listdir(tmp_path / "fast"), key=lambda n: int(n[5:-5]))[-1]
    procs, out = _start_ranks(tmp_path, "last", env), [[], []]
    for r, p in enumerate(procs):
        out[r].append(p.communicate(timeout=300)[0])
        assert p.returncode == 0, out[r]
    for r in (0, 1):
        got = json.loads((tmp_path / f"last.rank{r}.json").read_text())
        assert got["ckpt_path"] == str(tmp_path / "fast" / newest) and got["start"] == int(newest[5:-5]), got
