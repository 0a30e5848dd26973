"""A save's peak extra memory stays within max(64 MiB, 5% of the checkpoint) in every mode (issue #13 point 4).

Each case runs in a fresh subprocess: it builds the state, reads VmRSS, resets the peak (``5`` to
``/proc/self/clear_refs``), translates it to an ORT checkpoint where the plugin would (that is where
``ort_compatible`` used to cast), saves with checksums (the default), and reads VmHWM; the difference is what the
save added. The cases are the ones where bytes are converted on their way to the file (bfloat16 stored as float32
for ORT, views that are not contiguous, among them one whose first dimension is 1) and the plain ones (everything
inline, everything in ``.data``). Before the writer converted in bounded chunks, the ``ort_compatible`` case added
634 MiB (a whole float32 copy of the bfloat16 state) and the non-contiguous one 260 MiB (the ``(1, n)`` view copied
whole); now each adds one 16 MiB chunk. Every case also loads the file back and compares it with what was saved, so
a bound met by writing the wrong bytes fails too. An asynchronous save stages such tensors in their own narrow type
and converts them as it writes; a last test checks that the staged copy, not the live tensor, reaches the file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_ort_ckpt import load_checkpoint
from lightning_ort_ckpt._saving import _staging as staging
from lightning_ort_ckpt.format import StoredAs, save_checkpoint
from lightning_ort_ckpt._translation.lightning_dict import ModuleInfo, to_ort

LIMIT_MIN = 64 << 20  # max(64 MiB, 5% of the checkpoint): issue #13's bound on a save's extra memory

_CHILD = r"""
import json, os, sys
import torch
from lightning_ort_ckpt.format import CheckpointContents, OptimizerGroup, load_checkpoint, save_checkpoint
from lightning_ort_ckpt._translation.lightning_dict import ModuleInfo, to_ort

case, path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)


def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def transformer(dtype):
    # a decoder-only language model's tensors: 32k-token embedding, 4 blocks of width 1024 (~83M parameters)
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
    blocks = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    model = torch.nn.Sequential(torch.nn.Embedding(32000, 1024), blocks)
    return model.to(dtype)


expected = {}  # name -> the float32 or same-typed tensor the file must hold
if case == "ort_compatible_bf16":  # what OrtCheckpointIO(ort_compatible=True) does: to_ort, then the writer
    model = transformer(torch.bfloat16)
    sd = model.state_dict()
    names = [n for n, _ in model.named_parameters()]
    opt_state = {"state": {i: {"exp_avg": torch.randn_like(sd[n]) * 1e-3} for i, n in enumerate(names)},
                 "param_groups": [{"lr": 1e-3, "params": list(range(len(names)))}]}
    make = lambda: to_ort({"state_dict": sd, "optimizer_states": [opt_state], "epoch": 1},
                          ModuleInfo(set(names), [names]), ort_compatible=True)
    expected = {n: t.float() for n, t in sd.items()}
    mode = "auto"
elif case == "noncontiguous":  # transposed weights, and a (1, n) view of a transposed matrix (256 MiB)
    sd = transformer(torch.float32).state_dict()
    tensors = {n: t.t() if t.ndim == 2 else t for n, t in sd.items()}
    tensors["tied_head"] = torch.randn(8192, 8192).t().unsqueeze(0)
    assert not tensors["tied_head"].is_contiguous()
    make = lambda: CheckpointContents(frozen=tensors)
    expected = tensors
    mode = "auto"
else:  # plain contiguous float32 state with AdamW-like moments, inline or all in .data
    sd = transformer(torch.float32).state_dict()
    states = {n: {"momentum0": torch.randn_like(t), "momentum1": torch.rand_like(t)} for n, t in sd.items()}
    make = lambda: CheckpointContents(trainable=dict(sd), optimizer_groups={"group0": OptimizerGroup(10, 1e-3, states)})
    expected = dict(sd)
    mode = {"inline": "never", "external": "all"}[case]

rss = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
save_checkpoint(make(), path, external_data=mode)
extra = status("VmHWM") - rss
size = sum(os.path.getsize(p) for p in (path, path + ".data") if os.path.exists(p))
loaded = load_checkpoint(path)  # verifies every checksum
got = {**loaded.trainable, **loaded.frozen}
wrong = [n for n, t in expected.items() if not torch.equal(got[n], t.contiguous())]
print(json.dumps({"extra": extra, "size": size, "wrong": wrong, "external": os.path.exists(path + ".data")}))
"""


def _run(case: str, tmp_path: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), case, str(tmp_path / "m.ckpt")],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["inline", "external", "ort_compatible_bf16", "noncontiguous"])
def test_save_peak_extra_memory_is_bounded(case: str, tmp_path: Path) -> None:
    res = _run(case, tmp_path)
    assert res["wrong"] == []
    assert res["size"] > 300 << 20  # large enough that a whole copy of any of its big tensors would show
    assert res["external"] == (case == "external")
    limit = max(LIMIT_MIN, 0.05 * res["size"])
    assert res["extra"] <= limit, (f"{case}: the save added {res['extra'] / 2**20:.1f} MiB, more than "
                                   f"{limit / 2**20:.1f} MiB ({res['size'] / 2**20:.0f} MiB checkpoint)")


def test_async_staging_keeps_ort_compatible_tensors_narrow_and_owned(tmp_path: Path) -> None:
    """An asynchronous save stages a bfloat16 tensor that is to be stored as float32 in its own bfloat16 copy (half
    the memory of a float32 one) and converts it as it writes: training changing the tensor after the save call
    returned does not reach the file."""
    live = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    saved = live.float()
    ck = to_ort({"state_dict": {"w": live}}, ModuleInfo({"w"}, []), ort_compatible=True)
    staged, copy_later = staging.Stager().stage(ck, str(tmp_path / "a.ckpt"), [], [], lambda: None)
    copy_later()
    held = staged.trainable["w"]
    assert isinstance(held, StoredAs) and held.tensor.dtype == torch.bfloat16
    assert held.tensor.data_ptr() != live.data_ptr()
    live.add_(1.0)  # the next optimizer step
    save_checkpoint(staged, tmp_path / "a.ckpt")
    stored = load_checkpoint(tmp_path / "a.ckpt").trainable["w"]
    assert stored.dtype == torch.float32 and torch.equal(stored, saved)
