"""Resuming from one of our files costs the memory a resume from Lightning's own ``.ckpt`` costs (issue #13, point 1).

After ``fit(ckpt_path=...)`` torch keeps the loaded optimizer moments as they are; when they were views into one
buffer holding the whole file, the parameters' bytes (and everything else of the file) stayed alive with them, for
the rest of the run (32M parameters + AdamW: 826 MiB against 698 MiB). A full load now reads each tensor into
memory of its own, so only the moments stay.

Each measurement runs in a fresh process: one fits a TiedTransformer of the zoo (32.9M parameters, AdamW) for two
steps and saves it three ways (Lightning's torch ``.ckpt``, ours inline, ours with the parameters in ``.data``);
then, for each file, a fresh process builds the same model and Trainer (``OrtCheckpointIO`` plugin, which hands torch
files to Lightning's own ``TorchCheckpointIO``), resumes with ``fit(ckpt_path=...)`` for one more step and reports
VmRSS (after the fit, model, trainer and optimizer alive) and VmHWM (the peak, the load included). Ours must not
exceed the native resume's by more than 5%, in RSS and in peak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
VOCAB, WIDTH = 28_000, 1024  # tied embedding 28.7M + transformer block 4.2M parameters

CHILD = textwrap.dedent('''
    import gc, json, sys, warnings
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_ort_ckpt import OrtCheckpointIO
    from zoo_models import TiedTransformer

    warnings.filterwarnings("ignore")
    mode, out = sys.argv[1], sys.argv[2:]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randint(0, {vocab}, (16, 5), generator=g),
                                    torch.randint(0, {vocab}, (16,), generator=g)), batch_size=4)

    def trainer(steps, plugin):
        return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, plugins=[plugin])

    def status(key):
        return int([l for l in open("/proc/self/status") if l.startswith(key + ":")][0].split()[1])

    if mode == "make":
        for path, plugin in zip(out, (None, OrtCheckpointIO(external_data="never"),
                                      OrtCheckpointIO(external_data="params"))):
            torch.manual_seed(0)
            t = trainer(2, plugin) if plugin is not None else pl.Trainer(
                max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False)
            t.fit(TiedTransformer({vocab}, {width}), data)
            t.save_checkpoint(path)
    else:
        model = TiedTransformer({vocab}, {width})
        t = trainer(3, OrtCheckpointIO())
        t.fit(model, data, ckpt_path=out[0])
        gc.collect()
        opt = t.optimizers[0]
        steps = sorted({{float(s["step"]) for s in opt.state.values()}})
        moments = sum(s[k].numel() * 4 for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
        print(json.dumps({{"rss_kib": status("VmRSS"), "hwm_kib": status("VmHWM"), "steps": steps,
                          "params": sum(p.numel() for p in model.parameters()), "moment_bytes": moments}}))
''').format(vocab=VOCAB, width=WIDTH)


def _run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_memory")
    paths = {"native": str(root / "native.ckpt"), "inline": str(root / "inline.ckpt"),
             "external": str(root / "external.ckpt")}
    _run("make", paths["native"], paths["inline"], paths["external"])
    assert os.path.exists(paths["external"] + ".data") and not os.path.exists(paths["inline"] + ".data")
    return paths


def _resume(path: str) -> dict:
    return json.loads(_run("resume", path).strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["inline", "external"])
def test_resumed_memory_equals_a_native_resume(files, kind):
    native, ours = _resume(files["native"]), _resume(files[kind])
    mib = lambda kib: kib / 1024  # noqa: E731
    print(f"\n{kind}: {ours['params'] / 1e6:.1f}M params, AdamW moments {ours['moment_bytes'] / 2**20:.0f} MiB; "
          f"resumed RSS ours {mib(ours['rss_kib']):.0f} MiB vs native {mib(native['rss_kib']):.0f} MiB "
          f"({ours['rss_kib'] / native['rss_kib']:.3f}x); peak ours {mib(ours['hwm_kib']):.0f} MiB vs native "
          f"{mib(native['hwm_kib']):.0f} MiB ({ours['hwm_kib'] / native['hwm_kib']:.3f}x)")
    assert ours["steps"] == native["steps"] == [3.0]  # the moments were restored, and trained one more step
    assert ours["rss_kib"] <= 1.05 * native["rss_kib"]
    assert ours["hwm_kib"] <= 1.05 * native["hwm_kib"]
