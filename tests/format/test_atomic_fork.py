"""The local disk's commit in forked processes, with nothing registered process-wide: no at-fork handler at import or
at any save, and a child forked while its parent's threads hold the sweep and unlink locks saves without hanging.

Each case runs in a fresh interpreter (only the format layer imported) that forks for real."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LIMIT_S = 60  # bounds a hang (a child stuck on a lock its parent's thread held at the fork)

_PRELUDE = """
import json, os, sys
calls = []
real = os.register_at_fork
def recording(**kwargs):
    calls.append(sorted(f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', f)}" for f in kwargs.values()))
    return real(**kwargs)
os.register_at_fork = recording
from lightning_ort_ckpt.format import _atomic as atomic
from lightning_ort_ckpt.format._atomic import _cleanup

def save(path, payload):
    with atomic.atomic_save(path, with_data=False, required_bytes=0) as files:
        files.main.write(payload)
"""


def _run(tmp_path: Path, body: str) -> dict:
    script = _PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=LIMIT_S)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_no_at_fork_handler_at_import_or_at_saves_and_removals(tmp_path: Path) -> None:
    out = _run(tmp_path, """
        path = os.path.join(sys.argv[1], "a.ckpt")
        save(path, b"one")
        save(path, b"two")  # the replaced file goes to the unlink thread
        atomic.remove(path)
        atomic.wait_for_cleanup()
        print(json.dumps({"ours": [c for c in calls if any("lightning_ort_ckpt" in f for f in c)],
                          "left": sorted(os.listdir(sys.argv[1]))}))
    """)
    assert out == {"ours": [], "left": []}


@pytest.mark.skipif(sys.platform == "win32", reason="os.fork is POSIX")
def test_a_child_forked_while_the_locks_are_held_saves_and_cleans_up(tmp_path: Path) -> None:
    """The parent holds the sweep lock and the unlink queue's lock (as its threads may at any moment) and forks:
    the child's save sweeps, replaces and deletes with fresh ones of its own; the parent's state is untouched."""
    out = _run(tmp_path, """
        directory = sys.argv[1]
        save(os.path.join(directory, "parent.ckpt"), b"p")
        sweep_lock, _ = _cleanup._sweeps()
        unlink_lock = _cleanup.UNLINKER._lock
        with sweep_lock, unlink_lock:
            pid = os.fork()
            if pid == 0:
                path = os.path.join(directory, "child.ckpt")
                save(path, b"one")
                save(path, b"two")
                atomic.wait_for_cleanup()
                ok = open(path, "rb").read() == b"two" and sorted(os.listdir(directory)) == ["child.ckpt",
                                                                                          "parent.ckpt"]
                os._exit(0 if ok else 3)
            _, status = os.waitpid(pid, 0)
        save(os.path.join(directory, "parent.ckpt"), b"q")  # the parent's locks are its own still
        atomic.wait_for_cleanup()
        print(json.dumps({"child": os.waitstatus_to_exitcode(status), "left": sorted(os.listdir(directory)),
                          "pids": sorted(_cleanup._SWEEPS) == [os.getpid()]}))
    """)
    assert out == {"child": 0, "left": ["child.ckpt", "parent.ckpt"], "pids": True}
