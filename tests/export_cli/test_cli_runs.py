"""ort-ckpt for whole runs (issue 33, point 4): several paths, folders and globs with one summary line; ``ls`` of a
run directory; ``inspect`` telling parameters, buffers and Lightning's bookkeeping apart and spotting damage;
a damaged sharded folder named; ``--json`` everywhere; never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from helpers.cli import Net
from lightning_ort_ckpt import OrtCheckpoint, open_checkpoint




@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three epochs, top 2 by val_loss and last.ckpt: frozen sharing hard-links the .data of every save."""
    where = tmp_path_factory.mktemp("run") / "ckpts"
    callback = OrtCheckpoint(dirpath=where, monitor="val_loss", save_top_k=2, save_last=True)
    pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, callbacks=[callback],
               enable_progress_bar=False, enable_model_summary=False).fit(Net())
    return where


def cli(*args: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def damaged_copy(src: Path, dst: Path) -> Path:
    """A copy of ``src`` (and its .data) with one byte of its head.weight flipped."""
    shutil.copy(src, dst)
    if os.path.exists(str(src) + ".data"):
        shutil.copy(str(src) + ".data", str(dst) + ".data")
    with open_checkpoint(src) as reader:
        info = reader.trainable["head.weight"]
        offset = info.offset
    data = bytearray(dst.read_bytes())
    data[offset] ^= 0x40
    dst.write_bytes(bytes(data))
    return dst


def test_verify_takes_a_run_directory_and_globs_with_one_summary_line(run_dir: Path, tmp_path: Path) -> None:
    out = cli("verify", run_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\nOK ") + out.stdout.startswith("OK ") == 3
    assert out.stdout.splitlines()[-1] == "verified 3 checkpoint(s): 3 OK, 0 INVALID"
    out = cli("verify", f"{run_dir}/epoch=*.ckpt")  # .data companions are parts of their checkpoint, not units
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "verified 2 checkpoint(s): 2 OK, 0 INVALID"
    bad = damaged_copy(run_dir / "last.ckpt", tmp_path / "bad.ckpt")
    out = cli("verify", run_dir / "last.ckpt", bad, tmp_path / "nothing-*.ckpt")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    summary = f"verified 3 checkpoint(s): 1 OK, 2 INVALID ({bad}, {tmp_path}/nothing-*.ckpt)"
    assert out.stdout.splitlines()[-1] == summary
    assert f"INVALID {bad}" in out.stderr and "'head.weight'" in out.stderr
    assert "no file or folder matches" in out.stderr


def test_verify_json_for_several(run_dir: Path, tmp_path: Path) -> None:
    bad = damaged_copy(run_dir / "last.ckpt", tmp_path / "bad.ckpt")
    out = cli("verify", "--json", run_dir / "last.ckpt", bad)
    doc = json.loads(out.stdout)
    assert out.returncode == 1 and doc["summary"] == {"checkpoints": 2, "failed": 1}
    assert [c.get("valid", True) for c in doc["checkpoints"]] == [True, False]
    assert "head.weight" in doc["checkpoints"][1]["error"]


def test_inspect_counts_parameters_buffers_and_bookkeeping_apart(run_dir: Path) -> None:
    out = cli("inspect", run_dir / "last.ckpt")
    assert out.returncode == 0, out.stderr
    totals = next(line for line in out.stdout.splitlines() if line.startswith("totals:"))
    # head.weight and head.bias trained; frozen.weight, norm.weight, norm.bias and BatchNorm's 3 buffers frozen
    assert totals.startswith("totals: 2 trainable (1,026 elements), 6 frozen (264,193 elements), 9 of Lightning's ")
    assert " of Lightning's bookkeeping (random states, callback state)" in totals
    report = json.loads(cli("inspect", "--json", run_dir / "last.ckpt").stdout)
    roles = {p["name"]: p["role"] for p in report["parameters"]}
    assert roles["norm.running_mean"] == roles["frozen.weight"] == "buffer or frozen parameter"
    assert roles["head.weight"] == "parameter"
    assert {r for n, r in roles.items() if n.startswith("lightning:")} == {"Lightning bookkeeping"}
    assert report["totals"]["buffers_or_frozen_parameters"] == 6 and report["valid"]


def test_inspect_says_damaged_run_verify(run_dir: Path, tmp_path: Path) -> None:
    bad = damaged_copy(run_dir / "last.ckpt", tmp_path / "bad.ckpt")
    out = cli("inspect", bad)
    assert out.returncode == 1 and "parameter" in out.stdout  # the report is shown, then the damage
    assert out.stderr.strip().startswith(f"error: {bad}: damaged, run verify: ") and "'head.weight'" in out.stderr
    doc = json.loads(cli("inspect", "--json", bad).stdout)
    assert doc["valid"] is False and "head.weight" in doc["damaged"]


def test_ls_shows_the_run(run_dir: Path) -> None:
    out = cli("ls", run_dir)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["checkpoint", "step", "epoch", "val_loss", "size", "valid"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    doc = json.loads(cli("ls", "--json", run_dir).stdout)
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert set(rows) == set(by_name) and len(rows) == 3 and "last.ckpt" in rows  # the top 2 and last
    scores = {n: c["score"] for n, c in by_name.items()}
    best = min((n for n in by_name if n != "last.ckpt"), key=lambda n: scores[n])
    assert [n for n, c in by_name.items() if c["best"]] == [best] and rows[best].split()[-2:] == ["best", "ok"]
    assert [n for n, c in by_name.items() if c["last"]] == ["last.ckpt"]
    assert rows["last.ckpt"].split()[-3:] == ["last,", "unranked", "ok"]  # a copy of the newest: not ranked
    assert by_name["last.ckpt"]["step"] == 6 and by_name["last.ckpt"]["epoch"] == 2
    # the 1 MiB frozen layer lives in .data files hard-linked between saves (two copies): each inode counted once
    files = [str(f) for f in run_dir.iterdir() if not f.name.startswith(".")]
    apparent = sum(os.stat(f).st_size for f in files)
    once = sum(os.stat(f).st_size for f in {os.stat(f).st_ino: f for f in files}.values())
    assert doc["shared_bytes"] >= 1 << 20 and doc["bytes"] == once and doc["bytes"] + doc["shared_bytes"] == apparent
    assert lines[-1].startswith("3 checkpoint(s) in ") and "of hard-linked files counted once" in lines[-1]


def test_ls_says_why_a_checkpoint_is_not_valid(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpts"
    shutil.copytree(run_dir, copy)
    (copy / "epoch=9-step=99.ckpt").write_bytes(b"not a checkpoint")
    (copy / "half.ckpt").mkdir()
    out = cli("ls", copy)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:-1]}
    assert "not an ORT checkpoint" in rows["epoch=9-step=99.ckpt"]
    assert "half-written" in rows["half.ckpt"]
    assert out.stdout.splitlines()[-1].endswith("2 not valid (structure checked; --verify hashes every tensor)")
    damaged_copy(run_dir / "last.ckpt", copy / "last.ckpt")
    out = cli("ls", "--verify", copy)
    assert "'head.weight'" in next(line for line in out.stdout.splitlines() if line.startswith("last.ckpt"))


def test_ls_of_what_is_not_a_directory_is_one_line(tmp_path: Path) -> None:
    out = cli("ls", tmp_path / "missing")
    assert out.returncode == 1 and out.stderr.startswith("error: ") and len(out.stderr.splitlines()) == 1
    doc = json.loads(cli("ls", "--json", tmp_path / "missing").stdout)
    assert doc["ok"] is False


def test_a_sharded_folder_with_damaged_metadata_is_named(tmp_path: Path) -> None:
    from lightning_ort_ckpt._dcp._dcp_storage import METADATA_NAME, save_sharded

    folder = tmp_path / "epoch=0-step=1.ckpt"
    save_sharded({"state_dict": {"w": torch.ones(3)}, "global_step": 1, "epoch": 0}, str(folder))
    assert cli("verify", folder).returncode == 0
    (folder / METADATA_NAME).write_text('{"format": "lightning-ort-ckpt", "version"')
    for command in ("verify", "inspect"):
        out = cli(command, folder)
        assert out.returncode == 1 and len(out.stderr.splitlines()) == 1, out.stderr
        assert str(folder / METADATA_NAME) in out.stderr and "damaged metadata" in out.stderr
        assert "directory, not a file" not in out.stderr
    out = cli("ls", tmp_path)
    assert f"{METADATA_NAME} is damaged" in out.stdout and out.returncode == 1


def test_consolidate_and_export_speak_json(tmp_path: Path) -> None:
    out = cli("consolidate", "--json", tmp_path / "none.ckpt", tmp_path / "one.ckpt")
    assert out.returncode == 1 and json.loads(out.stdout)["ok"] is False and out.stderr == ""
