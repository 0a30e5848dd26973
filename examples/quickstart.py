"""Quickstart: train, save ORT checkpoints, get killed, resume from "last", export the best, check it in ORT.

Run by the README's demo command (`bash scripts/demo.sh`); everything runs on the CPU with data made in code. The
first run is a process of its own that is killed (SIGKILL, as a preempted machine is) in the middle of its third
epoch; the second run resumes from the newest checkpoint it left.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import warnings

import numpy as np
import onnxruntime
import pytorch_lightning as pl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_model import DemoModel, loaders, make_data  # noqa: E402

from lightning_ort_ckpt import OrtCheckpoint  # noqa: E402

OUT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "quickstart-out")
# 32 steps per epoch: the first run dies after step 70 of 128, in its third epoch, before its step-70 save; it
# resumes from its step-64 save (validation at the end of epoch 2), which makes the rest of the run bit for bit the
# uninterrupted one (a save mid-epoch resumes too, but Lightning restarts that epoch's DataLoader iterator)
EPOCHS, KILLED_AT = 4, 70


def quiet() -> None:
    """The demo shows our output only: Lightning's start-up banners and tips, and its notes about this set-up (a
    directory that already holds checkpoints is expected here: we resume into it), are silenced."""
    for name in ("pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in (".*isinstance\\(treespec, LeafSpec\\)", ".*does not have many workers",
                    ".*Checkpoint directory .* exists and is not empty"):
        warnings.filterwarnings("ignore", message=message)


def trainer(callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks)


def checkpoints() -> OrtCheckpoint:
    """Every 10 steps (the newest 2 kept) and whenever val_loss enters the top 2; last.ckpt always."""
    return OrtCheckpoint(dirpath=os.path.join(OUT, "checkpoints"), every_n_train_steps=10, keep_newest=2,
                         monitor="val_loss", save_top_k=2, save_last=True,
                         export_best_to=os.path.join(OUT, "model.onnx"))


class Preemption(pl.Callback):
    """Kills this process after step ``KILLED_AT``: no clean-up runs, as when a machine is taken away."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == KILLED_AT:
            print(f"   step {KILLED_AT}: the process is killed", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class StartStep(pl.Callback):
    """Records the step training starts from (after a resume restored it)."""

    step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def first_run() -> None:
    """The run that gets killed (a process of its own)."""
    pl.seed_everything(0, verbose=False)
    train, val = loaders()
    trainer([checkpoints(), Preemption()]).fit(DemoModel(), train, val)


def main() -> None:
    print(f"== 1. train {EPOCHS} epochs, saving ORT checkpoints; the training process dies on the way")
    killed = subprocess.run([sys.executable, os.path.abspath(__file__), OUT, "--first-run"])
    print(f"   the first run ended with exit status {killed.returncode} (killed by signal "
          f"{signal.Signals(-killed.returncode).name if killed.returncode < 0 else '-'}), not at its last step")

    print('== 2. resume with ckpt_path="last" (this process); the best checkpoint is exported at the end')
    pl.seed_everything(123, verbose=False)  # resuming does not depend on seeding: the random states are in the file
    train, val = loaders()
    second, start = checkpoints(), StartStep()
    run = trainer([second, start])
    run.fit(DemoModel(), train, val, ckpt_path="last")
    # trainer.ckpt_path: the file "last" resolved to (the newest valid checkpoint)
    print(f"   resumed from {os.path.relpath(run.ckpt_path, OUT)} at step {start.step}, finished at step "
          f"{run.global_step}")
    print(f"   {second.export_report}")

    print("== 3. the exported model in ONNX Runtime, on fresh data")
    x, y = (t.numpy() for t in make_data(n=1000, seed=7).tensors)
    session = onnxruntime.InferenceSession(os.path.join(OUT, "model.onnx"), providers=["CPUExecutionProvider"])
    accuracy = float((session.run(None, {"input": x})[0].argmax(1) == y).mean())
    print(f"   accuracy {accuracy:.3f} on 1000 new samples")

    print("== 4. what is on disk")
    for path in sorted(glob.glob(os.path.join(OUT, "checkpoints", "*"))):
        link = f" -> {os.readlink(path)}" if os.path.islink(path) else ""
        print(f"   {os.path.relpath(path, OUT)}  {os.path.getsize(path):,} bytes{link}")
    print(f"== ort-ckpt inspect {os.path.relpath(second.best_model_path, OUT)}")
    subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", "inspect", second.best_model_path], check=True)
    print(f"\nExport again from the command line:\n  {command_line_tool()} export {second.best_model_path} "
          f"--module {os.path.join(os.path.dirname(os.path.abspath(__file__)), 'demo_model.py')}:DemoModel "
          f"--output {os.path.join(OUT, 'model-cli.onnx')}")


def command_line_tool() -> str:
    """``ort-ckpt`` as a plain shell finds it: the script beside this Python (``.venv/bin/ort-ckpt`` after
    ``bash scripts/demo.sh``), relative to the current directory when it lies below it; the bare name only if the
    shell's PATH already leads to that script (an activated environment)."""
    script = os.path.join(os.path.dirname(sys.executable), "ort-ckpt")
    if not os.path.exists(script):  # the package is not installed in this environment, only importable
        return f"{sys.executable} -m lightning_ort_ckpt"
    if shutil.which("ort-ckpt") == script:
        return "ort-ckpt"
    relative = os.path.relpath(script)
    return relative if not relative.startswith(os.pardir) else script


if __name__ == "__main__":
    quiet()
    first_run() if "--first-run" in sys.argv else main()
