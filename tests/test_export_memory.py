"""``ort-ckpt export`` reads a checkpoint's weights once, and none of its optimizer state (issue #13, point 5).

It read the whole checkpoint twice, optimizer state included (a 400 MB model from a 1.2 GB AdamW checkpoint peaked
at 3.0 GB), and kept the first copy alive through the export.

Each measurement is the peak RSS (VmHWM) of a fresh process, for a TiedTransformer of the zoo with 100.5M float32
parameters (402 MB; its AdamW checkpoint holds 1.2 GB):

* the baseline exports a module instance of that shape with ``export_onnx``, from a torch file holding only its
  ``state_dict`` (read memory-mapped): the model itself, its weights read once, and what the export needs
  (``torch.onnx.export``, the ONNX model in memory, ONNX Runtime's session) — "the model plus ORT's";
* ours runs ``ort-ckpt export`` (the CLI, the module given as a class, so Lightning's ``load_from_checkpoint``
  builds it) on the 1.2 GB ORT checkpoint with AdamW state.

Ours must stay within the baseline plus half the model's size (1.5x the model plus ORT's). Reading the optimizer
state, or the weights twice, costs at least a model's worth more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
VOCAB, WIDTH = 94_000, 1024  # tied embedding 96.3M + transformer block 4.2M parameters

CHILD = textwrap.dedent('''
    import json, sys, warnings
    import torch
    from zoo_models import TiedTransformer

    warnings.filterwarnings("ignore")
    mode, args = sys.argv[1], sys.argv[2:]

    def hwm():
        return int([l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1])

    if mode == "make":
        import pytorch_lightning as pl
        from torch.utils.data import DataLoader, TensorDataset
        from lightning_ort_ckpt import OrtCheckpointIO

        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        data = DataLoader(TensorDataset(torch.randint(0, {vocab}, (4, 5), generator=g),
                                        torch.randint(0, {vocab}, (4,), generator=g)), batch_size=4)
        model = TiedTransformer({vocab}, {width})
        t = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, plugins=[OrtCheckpointIO()])
        t.fit(model, data)
        t.save_checkpoint(args[0])
        torch.save({{"state_dict": model.state_dict()}}, args[1])
        print(json.dumps({{"model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}}))
    elif mode == "baseline":
        from lightning_ort_ckpt.export import export_onnx

        torch.manual_seed(1)
        export_onnx(TiedTransformer({vocab}, {width}), args[0], args[1], tolerance=1e-3)
        print(json.dumps({{"hwm_kib": hwm()}}))
    else:
        from lightning_ort_ckpt.cli import main

        code = main(["export", args[0], "--module", "zoo_models:TiedTransformer", "-o", args[1], "--tolerance", "1e-3"])
        print(json.dumps({{"hwm_kib": hwm(), "code": code}}))
''').format(vocab=VOCAB, width=WIDTH)


def _run(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_export_reads_the_weights_once_and_no_optimizer_state(tmp_path):
    ort, weights = str(tmp_path / "adamw.ckpt"), str(tmp_path / "weights.pt")
    model_bytes = _run("make", ort, weights)["model_bytes"]
    checkpoint_bytes = os.path.getsize(ort) + (os.path.getsize(ort + ".data") if os.path.exists(ort + ".data") else 0)
    assert checkpoint_bytes > 2.9 * model_bytes  # weights and both AdamW moments
    baseline = _run("baseline", weights, str(tmp_path / "baseline.onnx"))["hwm_kib"] * 1024
    ours = _run("cli", ort, str(tmp_path / "ours.onnx"))
    assert ours["code"] == 0 and os.path.exists(tmp_path / "ours.onnx")
    peak = ours["hwm_kib"] * 1024
    mb = lambda n: n / 1e6  # noqa: E731
    print(f"\nmodel {mb(model_bytes):.0f} MB, checkpoint {mb(checkpoint_bytes):.0f} MB; peak RSS: ort-ckpt export "
          f"{mb(peak):.0f} MB, baseline (in-memory instance, weights-only file) {mb(baseline):.0f} MB; "
          f"excess {mb(peak - baseline):.0f} MB = {(peak - baseline) / model_bytes:.2f}x the model (bound 0.5x)")
    assert peak <= baseline + 0.5 * model_bytes
