"""``ort-ckpt`` tells one truth (issue 42, point 5), with real Trainers and real files: a checkpoint that reads whole
only through the other copy of its shared ``.data`` is damaged for ORT, and every command says so ("damaged copy,
healable") and exits 1; ``ls`` marks unranked rows, shows no stale score, and a long reason moves no other column;
``inspect`` and ``verify`` of a Fabric file show no "None"; ``consolidate`` of a plain file does not call it a
directory; a directory that cannot be read is an error, not an empty run; a warning is one line; folders written
through the public ``dcp.save``/``dcp.async_save`` with ``OrtStorageWriter`` are valid for ``verify``, ``inspect``
and ``consolidate`` (their verdict matches what ``OrtStorageReader`` loads)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed.checkpoint as dcp

from lightning_ort_ckpt import OrtCheckpoint
from lightning_ort_ckpt.dcp import OrtStorageReader, OrtStorageWriter
from lightning_ort_ckpt.format import load_checkpoint, open_checkpoint
from helpers.cli import Net

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def cli(*args: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4, generator=g)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7, "blob": b"\x00raw",
            "io": io.BytesIO(b"abc"), "ints": torch.arange(5)}


@pytest.mark.parametrize("save", ["save", "async_save"])
def test_a_public_dcp_folder_is_valid_for_every_command(tmp_path: Path, save: str) -> None:
    folder = tmp_path / "step-7"
    saved = _state()
    writer = OrtStorageWriter(folder)
    if save == "save":
        dcp.save(saved, storage_writer=writer)
    else:
        dcp.async_save(saved, storage_writer=writer).result()
        writer.close()
    loaded = _state()
    loaded.update(model={k: torch.zeros_like(v) for k, v in loaded["model"].items()}, blob=None, io=None)
    dcp.load(loaded, storage_reader=OrtStorageReader(folder))  # the reader loads it exactly
    assert all(torch.equal(loaded["model"][k], v) for k, v in saved["model"].items())

    out = cli("verify", folder)
    assert out.returncode == 0 and out.stdout.startswith(f"OK {folder}: "), out
    out = cli("inspect", "--json", folder)
    assert out.returncode == 0, out
    names = {p["name"] for p in json.loads(out.stdout)["parameters"]}
    assert {"lightning:model.weight", "lightning:optim.state.0.exp_avg", "lightning:ints"} <= names, names
    out = cli("consolidate", folder, tmp_path / "one.ckpt")
    assert out.returncode == 0, out
    one = load_checkpoint(tmp_path / "one.ckpt")
    assert torch.equal(torch.as_tensor(one.frozen["lightning:model.weight"]), saved["model"]["weight"])
    assert torch.equal(torch.as_tensor(one.frozen["lightning:ints"]), torch.arange(5))


def _train(where: Path, **callback: Any) -> Path:
    pl.Trainer(max_epochs=callback.pop("epochs", 3), accelerator="cpu", devices=1, logger=False,
               callbacks=[OrtCheckpoint(dirpath=where, monitor="val_loss", **callback)], enable_progress_bar=False,
               enable_model_summary=False).fit(Net())
    return where


def _rows(out: str) -> dict[str, str]:
    return {line.split()[0]: line for line in out.splitlines()[1:-1]}


def test_a_healable_damaged_copy_is_not_valid_in_any_command(tmp_path: Path) -> None:
    run = _train(tmp_path / "run", save_top_k=2, save_last=True)
    last = run / "last.ckpt"
    sharing = sorted(p.name for p in run.glob("*.ckpt") if os.path.samefile(f"{p}.data", f"{last}.data"))
    assert len(sharing) == 2 and len(list(run.glob("*.ckpt"))) == 3  # one shared .data, one other copy
    with open_checkpoint(last) as reader:
        offset = reader.frozen["frozen.weight"].offset
    os.chmod(f"{last}.data", 0o644)
    with open(f"{last}.data", "r+b") as f:  # one flipped byte of the shared frozen layer
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    said = "damaged copy, healable: run `ort-ckpt verify --repair`"

    out = cli("verify", run)
    assert out.returncode == 1, out
    for name in sharing:
        assert f"INVALID {run / name}: {said}: frozen tensor 'frozen.weight'" in out.stderr, out.stderr
    assert out.stdout.splitlines()[-1].startswith("verified 3 checkpoint(s): 1 OK, 2 INVALID"), out.stdout
    for verify in ([], ["--verify"]):
        out = cli("ls", *verify, run)
        rows = _rows(out.stdout)
        if verify:
            assert out.returncode == 1 and all(said in rows[n] for n in sharing), out.stdout
            assert sum("  ok" in row for row in rows.values()) == 1, out.stdout
        else:  # the structure alone is whole: ls without --verify hashes nothing, and says so
            assert out.returncode == 0 and out.stdout.splitlines()[-1].endswith("--verify hashes every tensor)")
    out = cli("inspect", last)
    assert out.returncode == 1 and out.stderr.startswith(f"error: {last}: {said}"), out.stderr
    assert cli("verify", "--repair", run).returncode == 0
    assert cli("ls", "--verify", run).returncode == 0 and cli("inspect", last).returncode == 0


def test_ls_marks_unranked_rows_shows_no_stale_score_and_keeps_its_columns(tmp_path: Path) -> None:
    """A save every step, validation once an epoch: the step-3 save is not ranked, and the score its callback
    state holds is step 2's (stale): ``-``. A long reason stays in the last column."""
    run = _train(tmp_path / "run", save_top_k=2, every_n_train_steps=1, epochs=2)
    (run / "epoch=0-step=1.ckpt").write_bytes(b"not a checkpoint " * 20)
    out = cli("ls", run)
    lines = out.stdout.splitlines()
    rows = _rows(out.stdout)
    assert set(rows) == {"epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "epoch=1-step=3.ckpt", "epoch=1-step=4.ckpt"}
    assert rows["epoch=1-step=3.ckpt"].split()[3] == "-" and "unranked" in rows["epoch=1-step=3.ckpt"]
    assert rows["epoch=0-step=2.ckpt"].split()[3] != "-" and "unranked" not in rows["epoch=0-step=2.ckpt"]
    assert "best" in rows["epoch=1-step=4.ckpt"] and "unranked" not in rows["epoch=1-step=4.ckpt"]
    doc = {c["name"]: c for c in json.loads(cli("ls", "--json", run).stdout)["checkpoints"]}
    assert doc["epoch=1-step=3.ckpt"]["ranked"] is False and doc["epoch=1-step=3.ckpt"]["score"] is None
    assert doc["epoch=0-step=2.ckpt"]["ranked"] is True and doc["epoch=0-step=2.ckpt"]["score"] is not None
    column = lines[0].index("valid")  # every row's verdict starts under the header, whatever the reasons' length
    assert all(line[column:].startswith(("ok", "not an ORT checkpoint")) for line in lines[1:-1]), lines
    assert len({len(line.split("  ok")[0]) for line in lines[1:-1] if "  ok" in line}) == 1, lines


def test_inspect_and_verify_of_a_fabric_file_show_no_none(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning")
    from lightning_ort_ckpt.lightning import OrtCheckpointIO

    plugin = OrtCheckpointIO()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    plugin.bind(fabric.strategy)
    model, optimizer = fabric.setup(*(lambda m: (m, torch.optim.AdamW(m.parameters())))(torch.nn.Linear(3, 2)))
    path = tmp_path / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    out = cli("inspect", path)
    assert out.returncode == 0 and "Fabric checkpoint: holds " in out.stdout, out
    out_verify = cli("verify", path)
    assert out_verify.returncode == 0 and "decodes (" in out_verify.stdout, out_verify
    assert "None" not in out.stdout + out_verify.stdout, out.stdout + out_verify.stdout


def test_consolidate_of_a_plain_file_does_not_call_it_a_directory(tmp_path: Path) -> None:
    run = _train(tmp_path / "run", save_top_k=1, epochs=1)
    plain = next(run.glob("*.ckpt"))
    out = cli("consolidate", plain, tmp_path / "one.ckpt")
    assert out.returncode == 1 and out.stderr.splitlines() == [
        f"error: {plain}: a file, not a sharded checkpoint folder: it is one checkpoint file already, nothing to "
        "consolidate"], out.stderr
    out = cli("consolidate", tmp_path / "missing", tmp_path / "one.ckpt")
    assert out.returncode == 1 and out.stderr == f"error: {tmp_path / 'missing'}: no such folder\n", out.stderr
    assert not (tmp_path / "one.ckpt").exists()


def _without_root_overrides() -> None:
    """In the child, before it runs: drop the two capabilities that let root read any directory (the tests run as
    root, for whom a mode of 000 means nothing), so that the directory's mode holds for it as for anyone."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, out of the bounding set for the exec
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_directory_that_cannot_be_read_is_an_error_not_an_empty_run(tmp_path: Path) -> None:
    run = _train(tmp_path / "run", save_top_k=1, epochs=1)
    run.chmod(0)
    try:
        outs = {command: subprocess.run([sys.executable, "-m", "lightning_ort_ckpt", command, str(run)],
                                        capture_output=True, text=True, timeout=300,
                                        preexec_fn=_without_root_overrides if os.geteuid() == 0 else None)
                for command in ("ls", "verify")}
    finally:
        run.chmod(0o755)
    assert outs["ls"].returncode == 1 and outs["ls"].stderr == \
        f"error: {run}: cannot read this directory (Permission denied)\n", outs["ls"]
    assert outs["verify"].returncode == 1, outs["verify"]
    assert f"INVALID {run}: cannot read this directory (Permission denied)" in outs["verify"].stderr
    assert "without checkpoints" not in outs["verify"].stderr
    assert cli("ls", run).returncode == 0  # readable again: the run is there


def test_a_warning_is_one_line_in_the_users_terms(tmp_path: Path) -> None:
    run = _train(tmp_path / "run", save_top_k=1, epochs=1)
    os.mkfifo(run / "pipe.ckpt")
    said = f"warning: {run / 'pipe.ckpt'} is skipped: it is not a regular file (a FIFO, socket or device)\n"
    for command in ("ls", "verify"):
        out = cli(command, run)
        assert out.returncode == 0 and out.stderr == said, out  # no source path, line number or code line
