"""ort-ckpt inspect / verify, run as a user would: a separate process, and without torch."""

import json
import subprocess
import sys

import numpy as np
import pytest

from lightning_ort_ckpt.format import CheckpointContents, OptimizerGroup, save_checkpoint


@pytest.fixture()
def ckpt(tmp_path):
    path = tmp_path / "model.ckpt"
    save_checkpoint(CheckpointContents(
        trainable={"fc.weight": np.ones((3, 4), np.float32), "fc.bias": np.zeros(3, np.float32)},
        frozen={"bn.num_batches_tracked": np.array(7, np.int64)},
        optimizer_groups={"group0": OptimizerGroup(step=5, initial_learning_rate=1e-3, states={
            n: {"momentum0": np.zeros(s, np.float32), "momentum1": np.zeros(s, np.float32)}
            for n, s in (("fc.weight", (3, 4)), ("fc.bias", (3,)))})},
        properties={"epoch": 2, "best_loss": 0.25, "run": "démo"}), path)
    return path


def run(*args, block_torch=False):
    prelude = "import sys; sys.modules['torch'] = None; " if block_torch else ""
    code = prelude + "from lightning_ort_ckpt._command._cli import main; sys.exit(main(sys.argv[1:]))"
    if not block_torch:
        code = "import sys; " + code
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)


def test_inspect_lists_everything(ckpt):
    out = run("inspect", ckpt, block_torch=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for expected in ("fc.weight", "trainable", "[3, 4]", "bn.num_batches_tracked", "frozen", "INT64",
                     "optimizer group group0: step 5, initial learning rate 0.001", "momentum0, momentum1",
                     "epoch (int) = 2", "best_loss (float) = 0.25", "run (str) = 'démo'",
                     "2 trainable (15 elements), 1 frozen (1 elements), 7 tensors"):
        assert expected in text, expected


def test_inspect_json_for_scripts(ckpt):
    out = run("inspect", "--json", ckpt, block_torch=True)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [p["name"] for p in report["parameters"]] == ["fc.bias", "fc.weight", "bn.num_batches_tracked"]
    assert report["totals"]["data_bytes"] == 3 * (12 + 3) * 4 + 8
    assert report["optimizer_groups"][0]["step"] == 5
    assert {p["name"]: p["value"] for p in report["properties"]} == {"epoch": 2, "best_loss": 0.25, "run": "démo"}
    assert report["files"] == {str(ckpt): ckpt.stat().st_size}


def test_verify_exit_status(ckpt, tmp_path):
    ok = run("verify", ckpt, block_torch=True)
    assert ok.returncode == 0 and ok.stdout.startswith("OK "), ok.stderr
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(ckpt.read_bytes()[:-40])
    out = run("verify", bad, block_torch=True)
    assert out.returncode == 1
    assert str(bad) in out.stderr and out.stderr.startswith("INVALID")
    missing = run("verify", tmp_path / "nope.ckpt")
    assert missing.returncode == 1 and "no such checkpoint file" in missing.stderr


def test_verify_notes_what_ort_cannot_load(tmp_path):
    path = tmp_path / "half.ckpt"
    save_checkpoint(CheckpointContents(trainable={"w": np.ones(2, np.float16)}), path)
    out = run("verify", path)
    assert out.returncode == 0
    assert "ORT 1.19.2 cannot load tensors of type FLOAT16" in out.stdout


def test_module_entry_point(ckpt):
    out = subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", "inspect", "--json", str(ckpt)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout)["version"] == 2
