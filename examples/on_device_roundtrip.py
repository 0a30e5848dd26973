"""Lightning -> ORT on-device training -> Lightning -> deployment, with the same checkpoint file format throughout.

1. Lightning trains the demo model (BatchNorm, Dropout) with OrtCheckpoint.
2. The best checkpoint becomes ORT training artifacts (training, eval and optimizer models) plus its starting state.
3. ONNX Runtime's on-device training API trains a few steps from it and saves its own checkpoint.
4. Lightning resumes from ORT's file (weights, AdamW moments and step come from ORT) and trains on.
5. The best checkpoint is exported to ONNX and checked against ONNX Runtime.
"""

from __future__ import annotations

import os
import sys

import onnxruntime
import pytorch_lightning as pl
from onnxruntime.training import api

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_model import DemoModel, loaders  # noqa: E402

from lightning_ort_ckpt import OrtCheckpoint, open_checkpoint  # noqa: E402
from lightning_ort_ckpt.artifacts import make_training_artifacts  # noqa: E402

OUT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "roundtrip-out")


def fit(max_epochs: int, dirpath: str, ckpt_path: str | None = None, **kwargs: object) -> OrtCheckpoint:
    callback = OrtCheckpoint(dirpath=os.path.join(OUT, dirpath), monitor="val_loss", save_top_k=1, save_last=True,
                             **kwargs)
    trainer = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    trainer.fit(DemoModel(), *loaders(), ckpt_path=ckpt_path)
    return callback


def main() -> None:
    onnxruntime.set_default_logger_severity(3)
    pl.seed_everything(0, verbose=False)
    print("== 1. Lightning: 2 epochs")
    lightning = fit(2, "lightning")
    print(f"   best: {os.path.basename(lightning.best_model_path)} (val_loss {float(lightning.best_model_score):.4f})")

    print("== 2. ORT training artifacts from the best checkpoint")
    art = make_training_artifacts(DemoModel, lightning.best_model_path, os.path.join(OUT, "artifacts"))
    print(f"   {len(art.trainable)} trainable and {len(art.frozen)} frozen tensors; models in {art.directory}")

    print("== 3. ONNX Runtime on-device training: 20 steps, then save")
    state = api.CheckpointState.load_checkpoint(art.checkpoint)
    module = api.Module(art.training_model, state, art.eval_model)
    optimizer = api.Optimizer(art.optimizer_model, module)
    optimizer.set_learning_rate(DemoModel().hparams.lr)
    train, val = loaders()
    module.train()
    for step, (x, y) in zip(range(20), train):
        loss = module(x.numpy(), y.numpy())
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    x, y = next(iter(val))
    print(f"   last training loss {float(loss):.4f}, eval loss {float(module(x.numpy(), y.numpy())):.4f}")
    ort_file = os.path.join(OUT, "ort_trained.ckpt")
    api.CheckpointState.save_checkpoint(state, ort_file, include_optimizer_state=True)
    with open_checkpoint(ort_file) as reader:
        print(f"   saved {ort_file}: optimizer step {reader.optimizer_groups['group0'].step}")

    print("== 4. Lightning resumes from ORT's file and trains 2 more epochs; the best is exported")
    resumed = fit(4, "resumed", ckpt_path=ort_file, export_best_to=os.path.join(OUT, "model.onnx"))
    print(f"   best: {os.path.basename(resumed.best_model_path)} (val_loss {float(resumed.best_model_score):.4f})")
    print(f"== 5. {resumed.export_report}")


if __name__ == "__main__":
    main()
