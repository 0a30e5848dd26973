"""``ort-ckpt`` tells one truth (issue 42, point 5), with real files: folders written through the public
``dcp.save``/``dcp.async_save`` with ``OrtStorageWriter`` are valid for ``verify``, ``inspect`` and ``consolidate``
(their verdict matches what ``OrtStorageReader`` loads)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_ort_ckpt.dcp import OrtStorageReader, OrtStorageWriter
from lightning_ort_ckpt.format import load_checkpoint

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
