"""Issue 25's escapes at the ``ort-ckpt`` command: metadata nested deeper than the JSON encoder recurses, names that
carry terminal escapes, a table that must align whatever the names, files that are not ORT checkpoints, and export
failures (torch missing, a bad tolerance, an error inside the export): one ``error:`` line and exit status 1, never a
traceback. Each runs the command in a fresh process, as a user does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from lightning_ort_ckpt.format import CheckpointContents, OptimizerGroup, load_checkpoint, save_checkpoint
from lightning_ort_ckpt._translation import MANIFEST
from helpers.cli import no_torch_env, run_cli

ROOT = Path(__file__).resolve().parents[2]


def assert_one_error_line(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert out.stderr.startswith("error: ") and len(out.stderr.splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for w in words:
        assert w in out.stderr, (w, out.stderr)


# -- 2. Lightning metadata nested 800 deep ------------------------------------------------------------------------
def test_deeply_nested_lightning_metadata(tmp_path, good):
    ck = load_checkpoint(good)
    manifest = json.loads(ck.properties[MANIFEST])
    deep = json.loads("[" * 800 + "]" * 800)
    manifest["values"]["epoch"] = deep
    manifest["values"]["pytorch-lightning_version"] = {"x": deep}
    manifest["keys"].append(deep)
    ck.properties[MANIFEST] = json.dumps(manifest)
    path = tmp_path / "deep.ckpt"
    save_checkpoint(ck, path)
    out = run_cli("inspect", "--json", path)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    report = json.loads(out.stdout)
    assert report["lightning"]["epoch"] == "<damaged: a list>" and report["lightning"]["global_step"] == 4
    out = run_cli("inspect", path)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "Lightning checkpoint: epoch <damaged: a list>, global step 4" in out.stdout
    out = run_cli("verify", path)
    assert out.returncode == 1 and out.stderr.startswith(f"INVALID {path}") and len(out.stderr.splitlines()) == 1
    assert "Lightning metadata" in out.stderr and "Traceback" not in out.stderr


# -- 5. names that carry terminal escapes ---------------------------------------------------------------------------
HOSTILE_NAMES = ["\x1b[2J\x1b[Hcleared", "title\x1b]0;pwned\x07", "line\nbreak", "bidi\u202eevil", "tab\there"]


def test_inspect_escapes_what_a_terminal_would_act_on(tmp_path):
    path = tmp_path / "names.ckpt"
    params = {n: np.ones(2, np.float32) for n in HOSTILE_NAMES}
    save_checkpoint(CheckpointContents(trainable=params, optimizer_groups={"g\x1b[31m": OptimizerGroup(
        step=1, states={n: {"m\x1b[0m": np.zeros(2, np.float32)} for n in HOSTILE_NAMES})},
        properties={"p\x1b[1m": "v\x1b[5m", "\x07bell": 1}), path)
    out = run_cli("inspect", path)
    assert out.returncode == 0, out.stderr
    assert not any(not c.isprintable() and c != "\n" for c in out.stdout), repr(out.stdout)
    for shown in (r"\x1b[2J\x1b[Hcleared", r"title\x1b]0;pwned\x07", r"line\nbreak", r"bidi\u202eevil",
                  r"tab\there", r"optimizer group g\x1b[31m", r"momentums m\x1b[0m", r"p\x1b[1m (str) = 'v\x1b[5m'",
                  r"\x07bell (int) = 1"):
        assert shown in out.stdout, (shown, out.stdout)
    out = run_cli("inspect", "--json", path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)  # valid JSON, and the names exactly as stored
    assert sorted(p["name"] for p in report["parameters"]) == sorted(HOSTILE_NAMES)
    assert report["optimizer_groups"][0]["name"] == "g\x1b[31m"
    assert {p["name"]: p["value"] for p in report["properties"]} == {"p\x1b[1m": "v\x1b[5m", "\x07bell": 1}
    assert "\x1b" not in out.stdout  # JSON escapes them as \u001b


def test_error_lines_escape_what_they_quote(tmp_path):
    path = tmp_path / "evil\x1b[2J.ckpt"
    path.write_bytes(b"not an ORT checkpoint at all")
    for command in ("inspect", "verify"):
        out = run_cli(command, path)
        assert out.returncode == 1 and "\x1b" not in out.stderr and r"evil\x1b[2J.ckpt" in out.stderr, out.stderr
        assert len(out.stderr.splitlines()) == 1


# -- 15. the table aligns whatever the names --------------------------------------------------------------------------
def columns(text: str) -> int:
    """Terminal columns: East Asian wide characters take two (the test's own count, from unicodedata)."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def test_inspect_table_aligns_whatever_the_name_lengths(tmp_path):
    names = ["w", "重み", "encoder.layers.11.self_attention.query_key_value.weight.with_a_very_long_suffix", "b"]
    shapes = [(2,), (3, 1), (1, 1, 1, 1, 1, 1, 1, 1, 2), ()]
    path = tmp_path / "table.ckpt"
    save_checkpoint(CheckpointContents(trainable={n: np.zeros(s, np.float32) for n, s in zip(names, shapes)}), path)
    out = run_cli("inspect", path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("parameter"))
    table = lines[start:start + 1 + len(names)]
    # the header's column titles and every row's cells start at the same terminal column
    starts = []
    for line in table:
        cells = [m.start() for m in re.finditer(r"(?<=  )\S", line)]  # each cell after the first follows 2+ spaces
        starts.append([columns(line[:i]) for i in cells])
    header = starts[0]
    kinds = [row[0] for row in starts]  # "kind" and "trainable" everywhere
    assert len(set(kinds)) == 1, table
    assert all(row[-1] == header[-1] for row in starts), table  # "storage" and "inline"
    widths = {columns(line[:line.rindex("  ") + 2]) for line in table}
    assert len(widths) == 1, table
    assert columns(table[0].split("  ")[0]) < kinds[0] and kinds[0] > columns(names[2])  # the name column holds all


# -- 14. files that are not ORT checkpoints, and export failures --------------------------------------------------
def test_inspect_says_what_a_foreign_file_is(tmp_path):
    model = torch.nn.Linear(3, 2)
    torch_ckpt = tmp_path / "model.ckpt"
    torch.save({"state_dict": model.state_dict()}, torch_ckpt)
    onnx_model = tmp_path / "model.onnx"
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    onnx.save(onnx.helper.make_model(graph), onnx_model)
    for path, words in ((torch_ckpt, "zip archive, as torch.save writes"), (onnx_model, "an ONNX model")):
        for command in ("inspect", "verify"):
            out = run_cli(command, path)
            assert out.returncode == 1 and words in out.stderr and str(path) in out.stderr, out.stderr
            assert "file identifier is b'" not in out.stderr and len(out.stderr.splitlines()) == 1


def test_export_without_torch_says_what_to_install(tmp_path, good):
    out = subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", "export", str(good), "--module", "x:Y",
                          "--output", str(tmp_path / "m.onnx")], capture_output=True, text=True,
                         env=no_torch_env(tmp_path), timeout=300)
    assert_one_error_line(out, "ort-ckpt export needs torch, which is not installed", "pip install torch")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("command", ["inspect", "verify", "consolidate"])
def test_a_sharded_directory_without_torch_says_what_to_install(tmp_path, command):
    from lightning_ort_ckpt._dcp._dcp_storage import save_sharded

    folder = tmp_path / "epoch=0-step=1.ckpt"
    save_sharded({"state_dict": {"w": torch.ones(3)}}, str(folder))
    out = subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", command, str(folder),
                          *([str(tmp_path / "one.ckpt")] if command == "consolidate" else [])],
                         capture_output=True, text=True, env=no_torch_env(tmp_path), timeout=300)
    assert_one_error_line(out, f"ort-ckpt {command} needs torch, which is not installed", "pip install torch")


@pytest.mark.parametrize("tolerance", ["-1", "nan", "inf", "abc"])
def test_a_bad_tolerance_is_refused_before_the_export_runs(tmp_path, good, tolerance):
    marker = tmp_path / "imported"
    module = tmp_path / "marks.py"
    module.write_text(f"open({str(marker)!r}, 'w').close()\nclass M:\n    pass\n")
    out = run_cli("export", good, "--module", f"{module}:M", "--output", tmp_path / "m.onnx",
                  f"--tolerance={tolerance}")
    assert out.returncode == 2 and "--tolerance" in out.stderr and "a number from 0 up" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not marker.exists() and not (tmp_path / "m.onnx").exists()  # nothing was imported or written


def test_an_error_inside_the_export_is_one_line(tmp_path, good):
    """--module names a function, not a class: whatever the export then raises is one line, exit status 1."""
    module = tmp_path / "notaclass.py"
    module.write_text("def build():\n    return None\n")
    out = run_cli("export", good, "--module", f"{module}:build", "--output", tmp_path / "m.onnx")
    assert_one_error_line(out)
    assert not (tmp_path / "m.onnx").exists()


# -- 15. the first steps: the commands the README and the demo show run in a plain shell ------------------------------
def test_readme_commands_run_in_a_plain_shell():
    """Every `ort-ckpt ...` line of the README's shell blocks comes after a line that activates .venv (or calls
    .venv/bin/ort-ckpt): in a plain shell the bare name is found only then."""
    readme = (ROOT / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("ort-ckpt "):
                assert any(p.startswith("source .venv/bin/activate") for p in lines[:i]), block
    assert 'pip install "lightning-ort-ckpt' not in readme  # not on an index: installed from the checkout
    assert 'pip install ".[ort]"' in readme
