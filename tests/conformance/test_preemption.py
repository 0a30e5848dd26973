"""Preemption: a training process that gets SIGTERM keeps every checkpoint it queued and resumes exactly.

A scheduler that preempts a machine sends SIGTERM and, after a grace period, SIGKILL. Lightning's signal connector
turns SIGTERM into ``SIGTERMException`` at the next loop boundary (a training batch, or a validation batch);
``OrtCheckpoint(save_on_exception=True)`` then saves the current step, the strategy's teardown drains the plugin's
background queue, and the process exits with status 0 (``SIGTERMException`` is a ``SystemExit``).

A child Python process trains with ``OrtCheckpoint(every_n_train_steps=1, save_top_k=-1, save_last=True,
save_on_exception=True)`` and prints what it does; the parent sends SIGTERM mid-epoch, mid-validation, or (with
``async_save=True``) while saves are still queued. Afterwards:

* the child exited with status 0 once every queued save was durable: every step file it queued is whole and loads,
  and none of its temporary files is left;
* ``last.ckpt`` holds the step at which the SIGTERM was handled;
* ``Trainer.fit(ckpt_path="last")`` in this process resumes from it, trains to the end, and ends bitwise equal to a
  run that was never interrupted, also after a SIGTERM during validation: the step's file was saved before that
  validation, and the resumed fit runs it again from its first batch (``_validation_resume``; see ``CASES``).

Nothing is mocked. Models stay small so that a case takes a few seconds; the child forks from
``tests/helpers/forkserver.py`` (torch and Lightning imported once).
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort_ckpt import OrtCheckpoint, load_checkpoint
from lightning_ort_ckpt._restore._reading import read_lightning_checkpoint
from helpers import forkserver
from helpers.loaders import ResumableShuffleLoader
from helpers.preemption import MAX_STEPS, Net

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
def loader(width: int) -> DataLoader:
    """A shuffled loader that saves its position: a plain DataLoader cannot resume mid-epoch exactly with any file
    format (docs/mapping.md). Its permutations and the model's Dropout make exactness depend on the random states."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, width, generator=g), torch.randn(24, width, generator=g))
    return ResumableShuffleLoader(data, batch_size=4)


def make_trainer(callbacks: list[pl.Callback]) -> pl.Trainer:
    """Without an OrtCheckpoint in ``callbacks``, no checkpointing at all (not Lightning's default in the cwd)."""
    return pl.Trainer(max_steps=MAX_STEPS, callbacks=callbacks, accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=any(isinstance(c, OrtCheckpoint) for c in callbacks),
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      val_check_interval=3, limit_val_batches=4)


def make_callback(dirpath: Path, async_save: bool) -> OrtCheckpoint:
    return OrtCheckpoint(dirpath, every_n_train_steps=1, save_top_k=-1, save_last=True, save_on_exception=True,
                         async_save=async_save)


class Announce(pl.Callback):
    """Says where training is, so the parent knows when to send SIGTERM (user callbacks run before checkpoint
    callbacks: at the start of a batch, every save of the steps before it has been asked for)."""

    def __init__(self, slow_disk: bool) -> None:
        self.slow_disk = slow_disk

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.slow_disk and trainer.global_step == 2:
            # a disk that stalls for 2 s: every save asked for after this waits in the queue behind it
            trainer.strategy.checkpoint_io._executor.run(time.sleep, 2.0)
        print(f"training {trainer.global_step}", flush=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # test-only look: are saves still queued at the signal?
        worker = getattr(trainer.strategy.checkpoint_io._executor, "_queue", None)
        busy = worker is not None and worker.busy()
        print(f"interrupted {trainer.global_step} {type(exception).__name__} busy={busy}", flush=True)


class WaitForSigterm(pl.Callback):
    """In the child: after the line the parent answers with SIGTERM, wait until the signal has arrived, so that it is
    handled at the boundary right after that line however loaded the machine (not a batch or a validation later)."""

    def __init__(self, when: str) -> None:
        self.when = when

    def _wait_after(self, trainer: pl.Trainer, line: str) -> None:
        if line == self.when:
            while not trainer.received_sigterm:
                time.sleep(0.01)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._wait_after(trainer, f"training {trainer.global_step}")  # after Announce printed it

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._wait_after(trainer, f"validating {trainer.global_step} {batch_idx}")  # after validation_step printed it


_CHILD = f"""
import sys
sys.path[:0] = [{TESTS_DIR!r}, {os.path.dirname(TESTS_DIR)!r}]  # this module, and helpers/
import pytorch_lightning as pl
from pathlib import Path
from test_preemption import Announce, Net, WaitForSigterm, loader, make_callback, make_trainer
dirpath, width, async_save, when = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
pl.seed_everything(0, verbose=False)
make_trainer([Announce(async_save), WaitForSigterm(when), make_callback(dirpath, async_save)]).fit(
    Net(width), loader(width), loader(width))
print("finished", flush=True)
"""

# when the parent sends SIGTERM (the child's line that starts with this), the model width, async saving, and
# whether the resumed run is bitwise equal to the uninterrupted one. A SIGTERM during the validation after step 3
# saves nothing new (step 3 was saved at its batch end, before that validation); Lightning alone would resume that
# file past the validation, without its random draws, and the weights would differ after it: the resumed fit runs
# the validation again (``_validation_resume``).
CASES = {
    "mid-epoch": ("training 4", 16, False, True),
    "mid-validation": ("validating 3 1", 16, False, True),
    # 2 x 256K parameters with AdamW: ~6 MB a save, every step, queued behind a 2 s stall of the background writer
    "async-in-flight": ("training 4", 512, True, True),
}


def run_child(tmp_path: Path, when: str, width: int, async_save: bool) -> tuple[int, str, int]:
    """Start the child, SIGTERM it at the line ``when``; its return code, output and the step it was stopped at."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_CHILD))
    proc = forkserver.spawn(script=str(script), args=[str(tmp_path / "ckpts"), str(width), str(int(async_save)), when],
                            cwd=str(tmp_path), merge_stderr=True)  # torch and Lightning imported once
    out = forkserver.signalled(proc, [(when, signal.SIGTERM)])
    interrupted = [line.split() for line in out.splitlines() if line.startswith("interrupted ")]
    assert interrupted, f"the child did not handle SIGTERM:\n{out}"
    return proc.returncode, out, int(interrupted[0][1])


@pytest.mark.parametrize("case", list(CASES))
def test_sigterm_keeps_every_save_and_resumes_exactly(tmp_path: Path, case: str) -> None:
    when, width, async_save, exact = CASES[case]
    returncode, out, step = run_child(tmp_path, when, width, async_save)
    assert returncode == 0, out  # SIGTERMException is a SystemExit: a scheduler reads this as "finished"
    assert "finished" not in out and "SIGTERMException" in out, out
    assert step < MAX_STEPS
    if async_save:
        assert "busy=True" in out, f"no save was in flight when SIGTERM came; the case tests nothing:\n{out}"

    dirpath = tmp_path / "ckpts"
    names = sorted(os.listdir(dirpath))
    assert not [n for n in names if n.startswith(".")], names  # no temporary or retired file left behind
    # every save the child asked for (one per step, none deleted) is whole, the interrupted step's included
    for s in range(1, step + 1):
        matches = [n for n in names if n.endswith(f"-step={s}.ckpt")]
        assert len(matches) == 1, (s, names)
        load_checkpoint(dirpath / matches[0])  # full validation of the file
    assert read_lightning_checkpoint(dirpath / "last.ckpt")["global_step"] == step

    # resume in this process with a fresh callback; it ends where an uninterrupted run ends, bit for bit
    pl.seed_everything(0, verbose=False)
    reference = Net(width)
    make_trainer([]).fit(reference, loader(width), loader(width))
    resumed = Net(width)
    trainer = make_trainer([make_callback(dirpath, False)])
    trainer.fit(resumed, loader(width), loader(width), ckpt_path="last")
    assert trainer.global_step == MAX_STEPS
    same = [torch.equal(a, b) for a, b in zip(reference.state_dict().values(), resumed.state_dict().values())]
    assert all(same) if exact else not all(same)

