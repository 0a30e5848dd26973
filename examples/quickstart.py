"""Quickstart: a torch run saved as an ORT checkpoint, trained further by ONNX Runtime, and read back.

This is the foundation-stage demo: it uses the format layer directly. The Lightning callback and plugin build on it.
Everything runs on the CPU with data made here; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import onnx
import onnxruntime
import torch
from torch import nn

from lightning_ort_ckpt.format import Checkpoint, OptimizerGroup, load_checkpoint, save_checkpoint


def make_data(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(dim=1) > 0).long()
    return x, y


def to_checkpoint(model: nn.Module, opt: torch.optim.AdamW) -> Checkpoint:
    """torch AdamW state -> ORT layout: exp_avg is momentum0, exp_avg_sq is momentum1, one group "group0"."""
    names = {id(p): n for n, p in model.named_parameters()}
    states = {names[id(p)]: {"momentum0": s["exp_avg"], "momentum1": s["exp_avg_sq"]} for p, s in opt.state.items()}
    step = int(next(iter(opt.state.values()))["step"])
    return Checkpoint(
        trainable={n: p for n, p in model.named_parameters() if p.requires_grad},
        frozen={n: b for n, b in model.named_buffers()},
        optimizer_groups={"group0": OptimizerGroup(step, opt.param_groups[0]["lr"], states)},
        properties={"global_step": step, "source": "torch quickstart"})


@contextlib.contextmanager
def quiet_native_stderr():
    """generate_artifacts logs every graph pass at info level from C++; hide that noise, keep Python errors."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def main() -> None:
    from onnxruntime.training import api, artifacts

    onnxruntime.set_default_logger_severity(3)
    torch.manual_seed(0)
    x, y = make_data()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.0)
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    print(f"torch: 20 AdamW steps, loss {loss.item():.4f}")

    work = tempfile.mkdtemp(prefix="ort-ckpt-quickstart-")
    ckpt = os.path.join(work, "torch_run.ckpt")
    save_checkpoint(to_checkpoint(model, opt), ckpt)
    print(f"saved {ckpt}; what is inside:")
    subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", "inspect", ckpt], check=True)

    # ORT on-device training picks up the same file: artifacts from the same module, names match state_dict keys.
    onnx_path = os.path.join(work, "model.onnx")
    warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export", category=DeprecationWarning)
    torch.onnx.export(model, (x[:4],), onnx_path, input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, dynamo=False,
                      do_constant_folding=False, training=torch.onnx.TrainingMode.EVAL)
    with quiet_native_stderr():
        artifacts.generate_artifacts(onnx.load(onnx_path), requires_grad=[n for n, _ in model.named_parameters()],
                                     loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=work)
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):  # ORT 1.19.2 reads IR <= 10
        m = onnx.load(os.path.join(work, name))
        if m.ir_version > 10:
            m.ir_version = 10
            onnx.save(m, os.path.join(work, name))
    state = api.CheckpointState.load_checkpoint(ckpt)
    module = api.Module(os.path.join(work, "training_model.onnx"), state, os.path.join(work, "eval_model.onnx"))
    optimizer = api.Optimizer(os.path.join(work, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(1e-2)
    module.train()
    for _ in range(10):
        ort_loss = module(x.numpy(), y.numpy())
        optimizer.step()
        module.lazy_reset_grad()
    ort_ckpt = os.path.join(work, "ort_run.ckpt")
    api.CheckpointState.save_checkpoint(state, ort_ckpt, include_optimizer_state=True)
    print(f"ORT: 10 more AdamW steps from our file, loss {float(np.asarray(ort_loss)):.4f}; saved {ort_ckpt}")

    back = load_checkpoint(ort_ckpt)
    model.load_state_dict({**back.trainable, **back.frozen})
    with torch.no_grad():
        final = nn.functional.cross_entropy(model(x), y).item()
    print(f"torch again: loaded ORT's checkpoint (optimizer step {back.optimizer_groups['group0'].step}), "
          f"loss {final:.4f}")


if __name__ == "__main__":
    main()
