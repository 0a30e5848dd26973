"""Quickstart: train, save ORT checkpoints, get interrupted, resume from "last", export the best, check it in ORT.

Run by the README's demo command (`bash scripts/demo.sh`); everything runs on the CPU with data made in code.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np
import onnxruntime
import pytorch_lightning as pl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_model import DemoModel, loaders, make_data  # noqa: E402

from lightning_ort_ckpt import OrtCheckpoint  # noqa: E402

OUT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "quickstart-out")


def trainer(max_epochs: int, callback: OrtCheckpoint) -> pl.Trainer:
    return pl.Trainer(max_epochs=max_epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[callback])


def checkpoints() -> OrtCheckpoint:
    """Every 10 steps (the newest 2 kept) and whenever val_loss enters the top 2; last.ckpt always."""
    return OrtCheckpoint(dirpath=os.path.join(OUT, "checkpoints"), every_n_train_steps=10, keep_newest=2,
                         monitor="val_loss", save_top_k=2, save_last=True,
                         export_best_to=os.path.join(OUT, "model.onnx"))


def main() -> None:
    pl.seed_everything(0, verbose=False)
    train, val = loaders()
    print("== 1. train 2 epochs, saving ORT checkpoints (then the run 'stops')")
    first = checkpoints()
    trainer(2, first).fit(DemoModel(), train, val)
    print(f"   best so far: {os.path.basename(first.best_model_path)} (val_loss {float(first.best_model_score):.4f})")

    print('== 2. resume with ckpt_path="last" and train to 4 epochs; the best checkpoint is exported at the end')
    pl.seed_everything(123, verbose=False)  # resuming does not depend on seeding: the random states are in the file
    second = checkpoints()
    run = trainer(4, second)
    run.fit(DemoModel(), train, val, ckpt_path="last")
    print(f"   resumed from {os.path.basename(first.last_model_path)}, finished at step {run.global_step}")
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
    print(f"\nExport again from the command line:\n  ort-ckpt export {second.best_model_path} "
          f"--module {os.path.join(os.path.dirname(os.path.abspath(__file__)), 'demo_model.py')}:DemoModel "
          f"--output {os.path.join(OUT, 'model-cli.onnx')}")


if __name__ == "__main__":
    main()
