"""A FIFO (or any file that is not a regular file) given as a checkpoint: our error naming it, from every entry point,
and never a hang (opening a FIFO for reading blocks until a writer comes; none ever does here).

Every entry point is tried in one child process, each under its own alarm, so that a regression fails the test of
that entry point (reported as a hang) instead of hanging the suite. The child imports everything the entry points
need (torch, Lightning, the package's Lightning classes) before the first alarm: an alarm bounds a call, never an
import, however loaded the machine. The child as a whole has a generous bound too (its imports included).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.cli import run_cli

ENTRY_SECONDS = 20  # each entry point's call, imports done: far more than an error takes, far less than a hang
CHILD_SECONDS = 600  # the whole child, imports on a loaded machine included: a hang of the child itself
ENTRY_POINTS = ["format.open_checkpoint", "format.load_checkpoint", "_reading.read_contents",
                "_reading.is_ort_checkpoint", "OrtCheckpointIO.load_checkpoint", "LightningModule.load_from_checkpoint"]

_CHILD = textwrap.dedent("""
    import json, signal, sys

    def hang(signum, frame):
        raise TimeoutError("hung")

    signal.signal(signal.SIGALRM, hang)
    path, seconds = sys.argv[1], int(sys.argv[2])

    # every import before the first alarm (the Lightning classes of the package load on first use)
    import pytorch_lightning as pl
    import torch
    import lightning_ort_ckpt
    from lightning_ort_ckpt._restore import _reading
    from lightning_ort_ckpt import format
    plugin = lightning_ort_ckpt.OrtCheckpointIO()

    def attempts():
        yield "format.open_checkpoint", lambda: format.open_checkpoint(path)
        yield "format.load_checkpoint", lambda: format.load_checkpoint(path)
        yield "_reading.read_contents", lambda: _reading.read_contents(path)
        yield "_reading.is_ort_checkpoint", lambda: _reading.is_ort_checkpoint(path)
        yield "OrtCheckpointIO.load_checkpoint", lambda: plugin.load_checkpoint(path)

        class Model(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(2, 2)

        def load_from_checkpoint():
            lightning_ort_ckpt.enable_ort_loading()
            try:
                return Model.load_from_checkpoint(path)
            finally:
                lightning_ort_ckpt.disable_ort_loading()

        yield "LightningModule.load_from_checkpoint", load_from_checkpoint

    for name, attempt in attempts():
        signal.alarm(seconds)
        try:
            attempt()
            outcome = {"error": None}
        except TimeoutError:
            outcome = {"error": "hang"}
        except BaseException as e:
            outcome = {"error": type(e).__name__, "families": [c.__name__ for c in type(e).__mro__],
                       "message": str(e)}
        finally:
            signal.alarm(0)
        print(json.dumps({"entry": name, **outcome}), flush=True)
""")


def _special_files(folder: Path) -> dict[str, Path]:
    """A FIFO and a listening Unix socket, each named like a checkpoint (a device needs root to make)."""
    fifo = folder / "pipe.ckpt"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "sock.ckpt"))
    return {"fifo": fifo, "socket": folder / "sock.ckpt"}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, object]]]:
    """For each special file, what each entry point did with it (missing: the child died or hung past its limit)."""
    folder = tmp_path_factory.mktemp("fifo")
    found: dict[str, dict[str, dict[str, object]]] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                       os.environ.get("PYTHONPATH", "")])}
    for kind, path in _special_files(folder).items():
        try:
            out = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(ENTRY_SECONDS)], capture_output=True,
                                 text=True, env=env, timeout=CHILD_SECONDS)
            lines = out.stdout
        except subprocess.TimeoutExpired as e:
            lines = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        found[kind] = {r["entry"]: {**r, "path": str(path)} for r in map(json.loads, lines.splitlines())}
    return found


@pytest.mark.parametrize("kind", ["fifo", "socket"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_special_file_gives_our_error_without_hanging(outcomes, entry: str, kind: str) -> None:
    got = outcomes[kind].get(entry)
    assert got is not None, f"{entry} did not answer for a {kind} (the child hung or died before it)"
    assert got["error"] != "hang", f"{entry} hung on a {kind}"
    assert got["error"] is not None, f"{entry} accepted a {kind} as a checkpoint"
    assert "CheckpointError" in got["families"], got  # type: ignore[operator]
    assert got["path"] in got["message"] and "not a regular file" in got["message"], got  # type: ignore[operator]


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_cli_refuses_a_fifo_in_one_line(tmp_path: Path, command: str) -> None:
    fifo = tmp_path / "pipe.ckpt"
    os.mkfifo(fifo)
    out = run_cli(command, fifo)
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr and "not a regular file" in out.stderr + out.stdout, out
    assert str(fifo) in out.stderr + out.stdout
