"""A training process SIGKILLed in the middle of an ``OrtCheckpoint`` save, synchronous and asynchronous.

A child Python process trains a model whose checkpoint (weights and AdamW state) takes a while to write, with
``OrtCheckpoint(every_n_train_steps=1, save_last=True)``. Once its first checkpoint is durable (the child says so on
stdout, after ``checkpoint_io.wait()``), the parent watches the directory and SIGKILLs the child while one of its
hidden temporary files ``.<name>.<pid>.<hex>.tmp`` is growing. Afterwards:

* every visible ``*.ckpt`` in the directory (``last.ckpt`` included) is a whole checkpoint that loads;
* ``Trainer.fit(ckpt_path="last")`` with a fresh ``OrtCheckpoint`` on the same directory resumes from the newest
  complete save (its step, its weights) and trains on;
* the dead process's temporary and retired files are gone once the resumed run has saved to the same directory
  (``atomic.wait_for_cleanup()``).

Nothing is mocked. The model is kept small enough (a ~50 MB file per save, two saves per step) that a case stays
within a few seconds; the children that are killed fork from ``tests/helpers/forkserver.py`` (torch and Lightning
imported once), the one about a process's own exit is a plain interpreter.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import OrtCheckpoint, load_checkpoint
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
from helpers import forkserver

pytestmark = [
    pytest.mark.filterwarnings("error::lightning_ort_ckpt.errors.CheckpointWarning"),
]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
WIDTH, LAYERS = 1024, 4  # 4 x 4.2 M float32 parameters: 16.8 MB of weights, ~50 MB per file with AdamW state
HOST_BOOT = "[0-9a-f]{8}-[0-9a-f]{8}"  # the host and boot tag in every temporary name
CHILD_MAX_STEPS = 8  # the child is killed long before (at its second or third step)


# -- model and data (the child imports these) ---------------------------------------------------------------------
class Big(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, WIDTH, generator=g), torch.randn(64, WIDTH, generator=g))
    return DataLoader(data, batch_size=4)  # 16 batches: the child never reaches the end of the epoch


def make_trainer(callbacks: list[pl.Callback], max_steps: int) -> pl.Trainer:
    return pl.Trainer(max_steps=max_steps, callbacks=callbacks, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


# OrtCheckpoint arguments besides dirpath, every_n_train_steps=1 and save_last=True; which of the child's saves after
# its first durable one is killed (1: step 2's file, 2: last.ckpt at step 2, 3: step 3's file, 4: last.ckpt at step
# 3); the file being written then, and the whole files (with their steps) the kill must leave.
CASES = {
    "sync-step_file": ({"save_top_k": -1}, 1, "epoch=0-step=2.ckpt",
                       {"epoch=0-step=1.ckpt": 1, "last.ckpt": 1}),
    "sync-last": ({"save_top_k": -1}, 2, "last.ckpt",
                  {"epoch=0-step=1.ckpt": 1, "epoch=0-step=2.ckpt": 2, "last.ckpt": 1}),
    "async-step_file": ({"save_top_k": -1, "async_save": True}, 1, "epoch=0-step=2.ckpt",
                        {"epoch=0-step=1.ckpt": 1, "last.ckpt": 1}),
    # retention: each step's file replaces the one before (save_top_k=1), or the oldest of three goes (keep_newest=2);
    # the deletion is queued behind the new file's write, and the kill comes during last.ckpt at step 3, after it
    "async-top_k_1-last": ({"save_top_k": 1, "async_save": True}, 4, "last.ckpt",
                           {"epoch=0-step=3.ckpt": 3, "last.ckpt": 2}),
    "async-keep_newest_2-last": ({"keep_newest": 2, "async_save": True}, 4, "last.ckpt",
                                 {"epoch=0-step=2.ckpt": 2, "epoch=0-step=3.ckpt": 3, "last.ckpt": 2}),
    # external data: parameters in <name>.data, written after the .ckpt's temporary; killed while that grows (a
    # name instead of a count: both temporaries of a save appear at once)
    "sync-params-step_file": ({"save_top_k": -1, "external_data": "params"}, "epoch=0-step=2.ckpt.data",
                              "epoch=0-step=2.ckpt.data", {"epoch=0-step=1.ckpt": 1, "last.ckpt": 1}),
    # last.ckpt and last.ckpt.data are symbolic links to the newest step file and its .data
    "async-link-params-step_file": ({"save_top_k": -1, "save_last": "link", "async_save": True,
                                     "external_data": "params"}, "epoch=0-step=2.ckpt.data",
                                    "epoch=0-step=2.ckpt.data", {"epoch=0-step=1.ckpt": 1, "last.ckpt": 1}),
}


class DurableMarker(pl.Callback):
    """Prints ``durable <step>`` once the checkpoints of ``step`` are on disk.

    Lightning runs checkpoint callbacks after all others, so at the end of step 2 this runs before step 2's save
    and after step 1's (which, for async saving, ``wait()`` makes durable). It waits only once: later saves stay
    asynchronous.
    """

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            trainer.strategy.checkpoint_io.wait()
            print(f"durable {trainer.global_step - 1}", flush=True)


_CHILD = f"""
import sys
sys.path[:0] = [{TESTS_DIR!r}, {os.path.dirname(TESTS_DIR)!r}]  # this module, and helpers/
from test_callback_crash import CASES, CHILD_MAX_STEPS, Big, DurableMarker, loader, make_trainer
from lightning_ort_ckpt import OrtCheckpoint
dirpath, case = sys.argv[1], sys.argv[2]
callback = OrtCheckpoint(dirpath, every_n_train_steps=1, **{{"save_last": True, **CASES[case][0]}})
make_trainer([DurableMarker(), callback], CHILD_MAX_STEPS).fit(Big(), loader())
print("finished", flush=True)
"""


# -- helpers ------------------------------------------------------------------------------------------------------
def visible_checkpoints(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(".ckpt") and not p.name.startswith("."))


def leftovers(directory: Path, pid: int | None = None) -> list[str]:
    """Temporary, retired and journal files (of process ``pid`` if given)."""
    names = [n for n in os.listdir(directory) if n.endswith((".tmp", ".old", atomic.JOURNAL_SUFFIX))]
    return sorted(n for n in names if pid is None or f".{pid}." in n)


def kill_while_saving(proc: forkserver.Child, directory: Path, nth: int | str,
                      timeout: float = 60) -> tuple[str, int]:
    """SIGKILL ``proc`` as soon as the ``nth`` temporary checkpoint file it creates (or the first temporary for the
    file named ``nth``) is seen being written: growing, or, where the save writes over a retired file of the same
    size (``format/_atomic/_cleanup``: spares), with a new modification time.

    Returns the checkpoint name that file was for, and its size when the kill was sent.
    """
    tmp_re = re.compile(rf"^\.(.+\.ckpt(?:\.data)?)\.{HOST_BOOT}\.{proc.pid}\.[0-9a-f]+\.tmp$")
    seen: dict[str, tuple[int, int]] = {}  # temporary files in the order they appeared: last size, mtime
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        for entry in os.scandir(directory):
            m = tmp_re.match(entry.name)
            if not m:
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:  # committed (renamed) in the meantime
                continue
            before = seen.get(entry.name)
            if before is not None and (before[0] < st.st_size or before[1] != st.st_mtime_ns) and (
                    m.group(1) == nth if isinstance(nth, str) else list(seen).index(entry.name) == nth - 1):
                proc.send_signal(signal.SIGKILL)
                return m.group(1), st.st_size
            seen[entry.name] = (st.st_size, st.st_mtime_ns)
        time.sleep(0.0005)
    proc.kill()
    out, _ = proc.communicate()
    pytest.fail(f"no save of the child was seen in progress (seen: {seen}); child output:\n{out}")


def step_of(path: Path) -> int:
    return read_lightning_checkpoint(path)["global_step"]


class StartProbe(pl.Callback):
    """Records the step and weights the resumed run starts from."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step
        self.ckpt_path = trainer.ckpt_path
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


# -- the test -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_during_callback_save(tmp_path: Path, case: str) -> None:
    kwargs, nth, killed_name, whole = CASES[case]
    dirpath = tmp_path / "ckpts"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_CHILD))
    proc = forkserver.spawn(script=str(script), args=[str(dirpath), case], cwd=str(tmp_path), merge_stderr=True)
    try:
        lines = []
        for line in proc.stdout:  # the child's own output until its first checkpoint is durable
            lines.append(line)
            if line.startswith("durable "):
                break
        else:
            proc.wait()
            pytest.fail("the child ended before its first checkpoint was durable:\n" + "".join(lines))
        killed = kill_while_saving(proc, dirpath, nth)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL, "".join(lines) + out
    assert "finished" not in out

    # The kill left its temporary file behind; every visible checkpoint is whole.
    dead_files = leftovers(dirpath, proc.pid)
    assert any(n.endswith(".tmp") for n in dead_files), (killed, os.listdir(dirpath))
    files = visible_checkpoints(dirpath)
    steps, weights = {}, {}
    for path in files:
        load_checkpoint(path)  # every tensor read back, sizes checked against the file
        checkpoint = read_lightning_checkpoint(path)
        steps[path.name], weights[path.name] = checkpoint["global_step"], checkpoint["state_dict"]
    print(f"killed while writing {killed[0]} ({killed[1]:,} bytes); whole files: {steps}")
    assert killed[0] == killed_name, killed
    assert steps == whole, os.listdir(dirpath)  # nothing lost, nothing deleted too early or left undeleted
    assert (dirpath / "last.ckpt").is_symlink() == (kwargs.get("save_last") == "link")
    newest = max(steps.values())

    # Resume with a fresh callback on the same directory. Saving the next step (and last.ckpt) again rewrites the
    # names the dead process was writing, which sweeps its leftovers.
    probe = StartProbe()
    callback = OrtCheckpoint(dirpath, every_n_train_steps=1, **{"save_last": True, **kwargs})
    trainer = make_trainer([probe, callback], max_steps=newest + 1)
    trainer.fit(Big(), loader(), ckpt_path="last")
    resumed_from = Path(probe.ckpt_path)
    assert resumed_from.name in steps, (resumed_from, steps)
    assert probe.step == steps[resumed_from.name] == newest, (probe.step, resumed_from, steps)
    saved_weights = weights[resumed_from.name]  # as it was before the resumed run rewrote last.ckpt
    assert saved_weights.keys() == probe.weights.keys()
    for k, v in saved_weights.items():
        assert torch.equal(v, probe.weights[k]), k
    assert trainer.global_step == newest + 1

    atomic.wait_for_cleanup()
    for path in visible_checkpoints(dirpath):
        load_checkpoint(path)
    # (in link mode the resumed run names its link last-v1.ckpt, as it does without any kill: last.ckpt exists)
    assert Path(callback.last_model_path).parent == dirpath and step_of(Path(callback.last_model_path)) == newest + 1
    assert (dirpath / f"epoch=0-step={newest + 1}.ckpt").exists()
    assert leftovers(dirpath) == [], os.listdir(dirpath)  # temporary and retired files of the dead run all swept


def orphaned_retired_files(directory: Path, pid: int) -> list[str]:
    """Retired files ``.<name>.<pid>.<hex>.old`` of process ``pid`` whose checkpoint ``name`` is gone."""
    pattern = re.compile(rf"^\.(.+)\.{HOST_BOOT}\.{pid}\.[0-9a-f]+\.old$")
    return sorted(n for n in os.listdir(directory)
                  if (m := pattern.match(n)) and not (directory / m.group(1)).exists())


_KILL_BETWEEN_RENAME_AND_UNLINK = f"""
import os, re, signal, sys
sys.path[:0] = [{TESTS_DIR!r}, {os.path.dirname(TESTS_DIR)!r}]  # this module, and helpers/
from test_callback_crash import CHILD_MAX_STEPS, Big, loader, make_trainer
from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.format import _atomic as atomic
real_put = atomic._UNLINKER.put

def put(path):  # the deletion of a rotated-out checkpoint: renamed to its trash name, not yet unlinked
    if re.match(r"^\\.epoch=.*\\.old$", os.path.basename(path)):
        os.kill(os.getpid(), signal.SIGKILL)
    real_put(path)

atomic._UNLINKER.put = put
callback = OrtCheckpoint(sys.argv[1], every_n_train_steps=1, save_top_k=1)
make_trainer([callback], CHILD_MAX_STEPS).fit(Big(), loader())
"""


def test_retired_file_of_a_deleted_checkpoint_is_swept(tmp_path: Path) -> None:
    """save_top_k=1: at step 2 the step-1 file is deleted, and the process dies right after renaming it away.
    The resumed run (steps 3 and 4, deleting steps 2 and 3 in turn) should leave nothing of the dead process."""
    dirpath = tmp_path / "ckpts"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_KILL_BETWEEN_RENAME_AND_UNLINK))
    proc = forkserver.spawn(script=str(script), args=[str(dirpath)], merge_stderr=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL, out
    assert sorted(p.name for p in visible_checkpoints(dirpath)) == ["epoch=0-step=2.ckpt"]
    assert orphaned_retired_files(dirpath, proc.pid) != [], os.listdir(dirpath)  # the file being deleted

    callback = OrtCheckpoint(dirpath, every_n_train_steps=1, save_top_k=1)
    trainer = make_trainer([callback], max_steps=4)
    trainer.fit(Big(), loader(), ckpt_path="last")
    assert trainer.global_step == 4
    atomic.wait_for_cleanup()
    # the step-2 file "last" resolved to rotates out as in the uninterrupted run (docs/callback.md, Retention)
    assert [p.name for p in visible_checkpoints(dirpath)] == ["epoch=0-step=4.ckpt"]
    assert leftovers(dirpath) == [], os.listdir(dirpath)



_ASYNC_RUN_THAT_EXITS = f"""
import sys
import torch
sys.path[:0] = [{TESTS_DIR!r}, {os.path.dirname(TESTS_DIR)!r}]  # this module, and helpers/
from test_callback_crash import Big, loader, make_trainer
from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.format import save_checkpoint, CheckpointContents
callback = OrtCheckpoint(sys.argv[1], every_n_train_steps=1, save_top_k=1, save_last=True, async_save=True)
make_trainer([callback], 3).fit(Big(), loader())
# fit returns once the saves are durable; the files they replaced or deleted may still be queued for unlinking.
# Then the program replaces a 256 MB export twice and exits: freeing the old .data takes a while, and the old .ckpt
# is queued behind it.
for i in range(2):
    save_checkpoint(CheckpointContents(trainable={{"w": torch.full((8192, 8192), float(i))}}), sys.argv[1] + "/final.ckpt",
                    external_data="params")
"""


def test_exit_deletes_everything_queued_for_deletion(tmp_path: Path) -> None:
    """Async saves with rotation, then a large replacing save: a process that exits right after leaves no hidden
    ``.old`` copy (the queue of files to unlink is drained at exit)."""
    dirpath = tmp_path / "ckpts"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_ASYNC_RUN_THAT_EXITS))
    proc = subprocess.run([sys.executable, str(script), str(dirpath)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(os.listdir(dirpath)) == ["epoch=0-step=3.ckpt", "final.ckpt", "final.ckpt.data", "last.ckpt"]
