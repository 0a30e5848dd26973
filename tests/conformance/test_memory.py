"""Resuming and exporting cost the memory of the state they need, no more (issue #13, points 1 and 5).

Every figure is read in a fresh process (VmRSS, VmHWM from ``/proc/self/status``), against a baseline measured in
the same test. The models are TiedTransformers of the zoo (an embedding tied to the output head, a transformer
block), float32, trained with AdamW.

**Resume** (:func:`test_resumed_memory_equals_a_native_resume`). After ``fit(ckpt_path=...)`` torch keeps the loaded
optimizer moments as they are; when they were views into one buffer holding the whole file, the parameters' bytes
(and the rest of the file) stayed alive with them for the rest of the run (32M parameters + AdamW: 826 MiB against
698 MiB). A full load now reads each tensor into memory of its own. One process fits a 32.9M-parameter model for
two steps and saves it three ways (Lightning's torch ``.ckpt``, ours inline, ours with the parameters in ``.data``);
then, per file, a fresh process builds the same model and Trainer (``OrtCheckpointIO``, which hands torch files to
Lightning's own ``TorchCheckpointIO``), resumes for one more step and reports VmRSS after the fit (model, trainer
and optimizer alive) and VmHWM (the peak, the load included). Ours must not exceed the native resume's by more than
5%, in either.

**Export** (:func:`test_export_reads_the_weights_once_and_no_optimizer_state`). ``ort-ckpt export`` read the whole
checkpoint twice, optimizer state included, and kept the first copy through the export. The model has 50.3M
parameters (201 MB; its AdamW checkpoint 0.6 GB: at 100.5M parameters the test took 50 s of the quiet suite, and
the excess it bounds was 5 MB, 0.01x the model; at 50.3M, 1 MB: reading the weights twice would still cost 2x the
bound). The baseline exports a module instance of that shape with
``export_onnx`` from a torch file holding only its ``state_dict`` (read memory-mapped): the model, its weights read
once, and what the export itself needs (``torch.onnx.export``, the ONNX model in memory, ONNX Runtime's session),
"the model plus ORT's". Ours runs ``ort-ckpt export`` (the module given as a class, built by Lightning's
``load_from_checkpoint``) on the AdamW checkpoint; its peak must stay within the baseline plus half the model
(1.5x the model plus ORT's). Reading the optimizer state, or the weights twice, costs at least a model more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # helpers/ is in it
ROOT = os.path.dirname(TESTS_DIR)
RESUME_VOCAB, EXPORT_VOCAB, WIDTH = 28_000, 45_000, 1024  # 32.9M and 50.3M parameters (block: 4.2M)

CHILD = textwrap.dedent('''
    import gc, json, sys, warnings
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_ort_ckpt import OrtCheckpointIO
    from helpers.zoo_models import TiedTransformer

    warnings.filterwarnings("ignore")
    mode, vocab, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randint(0, vocab, (16, 5), generator=g),
                                    torch.randint(0, vocab, (16,), generator=g)), batch_size=4)

    def trainer(steps, plugin=None):
        return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False,
                          plugins=None if plugin is None else [plugin])

    def status(key):
        return int([l for l in open("/proc/self/status") if l.startswith(key + ":")][0].split()[1])

    if mode == "make":  # args: paths, each with the plugin setting that writes it ("torch": Lightning's torch file;
        # "weights": only the state_dict of a fresh module, as torch.save writes it)
        for path, setting in zip(args[::2], args[1::2]):
            if setting == "weights":
                torch.save({{"state_dict": TiedTransformer(vocab, {width}).state_dict()}}, path)
                continue
            torch.manual_seed(0)
            model = TiedTransformer(vocab, {width})
            t = trainer(2, None if setting == "torch" else OrtCheckpointIO(external_data=setting))
            t.fit(model, data)
            t.save_checkpoint(path)
        print(json.dumps({{"model_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}}))
    elif mode == "resume":
        model = TiedTransformer(vocab, {width})
        t = trainer(3, OrtCheckpointIO())
        t.fit(model, data, ckpt_path=args[0])
        gc.collect()
        steps = sorted({{float(s["step"]) for s in t.optimizers[0].state.values()}})
        print(json.dumps({{"rss_kib": status("VmRSS"), "hwm_kib": status("VmHWM"), "steps": steps}}))
    elif mode == "export-instance":
        from lightning_ort_ckpt.export import export_onnx

        export_onnx(TiedTransformer(vocab, {width}), args[0], args[1], tolerance=1e-3)
        print(json.dumps({{"hwm_kib": status("VmHWM")}}))
    else:
        from lightning_ort_ckpt._command._cli import main

        code = main(["export", args[0], "--module", "helpers.zoo_models:TiedTransformer", "-o", args[1],
                     "--tolerance", "1e-3"])
        print(json.dumps({{"hwm_kib": status("VmHWM"), "code": code}}))
''').format(width=WIDTH)


def _run(mode: str, vocab: int, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(vocab), *args], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def resume_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_memory")
    paths = {"native": str(root / "native.ckpt"), "inline": str(root / "inline.ckpt"),
             "external": str(root / "external.ckpt")}
    _run("make", RESUME_VOCAB, paths["native"], "torch", paths["inline"], "never", paths["external"], "params")
    assert os.path.exists(paths["external"] + ".data") and not os.path.exists(paths["inline"] + ".data")
    return paths


@pytest.fixture(scope="module")
def native_resume(resume_files):
    """The baseline both kinds are held to: Lightning's own resume of its torch file, measured once."""
    return _run("resume", RESUME_VOCAB, resume_files["native"])


@pytest.mark.parametrize("kind", ["inline", "external"])
def test_resumed_memory_equals_a_native_resume(resume_files, native_resume, kind):
    native, ours = native_resume, _run("resume", RESUME_VOCAB, resume_files[kind])
    mib = lambda kib: kib / 1024  # noqa: E731
    print(f"\n{kind}: resumed RSS ours {mib(ours['rss_kib']):.0f} MiB vs native {mib(native['rss_kib']):.0f} MiB "
          f"({ours['rss_kib'] / native['rss_kib']:.3f}x); peak ours {mib(ours['hwm_kib']):.0f} MiB vs native "
          f"{mib(native['hwm_kib']):.0f} MiB ({ours['hwm_kib'] / native['hwm_kib']:.3f}x)")
    assert ours["steps"] == native["steps"] == [3.0]  # the moments were restored, and trained one more step
    assert ours["rss_kib"] <= 1.05 * native["rss_kib"]
    assert ours["hwm_kib"] <= 1.05 * native["hwm_kib"]


def test_export_reads_the_weights_once_and_no_optimizer_state(tmp_path):
    ort, weights = str(tmp_path / "adamw.ckpt"), str(tmp_path / "weights.pt")
    model_bytes = _run("make", EXPORT_VOCAB, weights, "weights", ort, "auto")["model_bytes"]
    checkpoint_bytes = os.path.getsize(ort) + (os.path.getsize(ort + ".data") if os.path.exists(ort + ".data") else 0)
    assert checkpoint_bytes > 2.9 * model_bytes  # weights and both AdamW moments
    baseline = _run("export-instance", EXPORT_VOCAB, weights, str(tmp_path / "baseline.onnx"))["hwm_kib"] * 1024
    ours = _run("export-cli", EXPORT_VOCAB, ort, str(tmp_path / "ours.onnx"))
    assert ours["code"] == 0 and os.path.exists(tmp_path / "ours.onnx")
    peak = ours["hwm_kib"] * 1024
    mb = lambda n: n / 1e6  # noqa: E731
    print(f"\nmodel {mb(model_bytes):.0f} MB, checkpoint {mb(checkpoint_bytes):.0f} MB; peak RSS: ort-ckpt export "
          f"{mb(peak):.0f} MB, baseline (instance, weights-only file) {mb(baseline):.0f} MB; excess "
          f"{mb(peak - baseline):.0f} MB = {(peak - baseline) / model_bytes:.2f}x the model (bound 0.5x)")
    assert peak <= baseline + 0.5 * model_bytes
