"""A fork server for the crash tests' children: one process imports torch and Lightning once, then forks a child per
request, so a child that is SIGKILLed mid-save starts in milliseconds instead of importing both again (seconds,
tens of seconds on a loaded machine).

A child is a fresh process as far as the package is concerned: the server imports only third-party modules (never
``lightning_ort_ckpt`` or a test module), and each child gets the caller's environment, working directory, argv and
``sys.path[0]`` as ``python script.py`` or ``python -c code`` would; its stdout and stderr are the caller's pipes
(passed over a Unix socket). It exits through ``atexit`` as an interpreter does. A test that is about the exit of a
real interpreter keeps a plain ``subprocess`` child.

``spawn(...)`` returns a :class:`Child`, a small ``subprocess.Popen`` look-alike (``pid``, ``stdout``, ``poll``,
``wait``, ``communicate``, ``send_signal``, ``kill``, ``returncode``). The server is started on first use, once per
test process, and ends with it (its stdin is a pipe from the test process: EOF ends it).
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

PRELOAD = ("numpy", "torch", "pytorch_lightning")

_SERVER = r'''
import atexit, json, os, select, signal, socket, sys, traceback
for name in sys.argv[2:]:
    __import__(name)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(16)
print("ready", flush=True)
children = {}  # pid -> connection that waits for its status
base_path = list(sys.path[1:])


def run_child(request, fds):
    listener.close()
    for conn in children.values():
        conn.close()
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    code = 0
    try:
        if request["script"] is not None:
            sys.argv = [request["script"], *request["args"]]
            sys.path[:] = [os.path.dirname(os.path.abspath(request["script"])), *base_path]
            source = open(request["script"]).read()
            filename = request["script"]
        else:
            sys.argv = ["-c", *request["args"]]
            sys.path[:] = ["", *base_path]
            source, filename = request["code"], "<string>"
        scope = {"__name__": "__main__"}
        if request["script"] is not None:
            scope["__file__"] = filename
        exec(compile(source, filename, "exec"), scope)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


while True:
    ready, _, _ = select.select([listener, sys.stdin], [], [], 0.02)
    if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
        break  # the test process is gone
    if listener in ready:
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            run_child(request, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        children[pid] = conn
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            conn = children.pop(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
            finally:
                conn.close()
'''

_server: tuple[subprocess.Popen, str] | None = None


def _address() -> str:
    """The running server's socket, started on first use (with this process's environment and ``sys.path``)."""
    global _server
    if _server is None or _server[0].poll() is not None:
        folder = tempfile.mkdtemp(prefix="forkserver-")
        address = os.path.join(folder, "socket")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen([sys.executable, "-c", _SERVER, address, *PRELOAD], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the imports take as long as they take: no clock on a start-up
        assert line == b"ready\n", f"the fork server did not start: {line!r}"
        _server = (proc, address)
    return _server[1]


class Child:
    """A forked child, as much of ``subprocess.Popen`` as the tests use (``text=True``; stderr its own pipe, or
    ``stderr=subprocess.STDOUT``)."""

    def __init__(self, request: dict[str, Any], merge_stderr: bool) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = (out_r, out_w) if merge_stderr else os.pipe()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_address())
        socket.send_fds(self._conn, [json.dumps(request).encode()], [out_w, err_w])
        os.close(out_w)
        if not merge_stderr:
            os.close(err_w)
        self._replies = self._conn.makefile("rb", buffering=0)
        self.pid: int = json.loads(self._replies.readline())["pid"]
        self.stdout = os.fdopen(out_r, "r")
        self.stderr = None if merge_stderr else os.fdopen(err_r, "r")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._collect()
        return self.returncode

    def _collect(self) -> None:
        line = self._replies.readline()
        assert line, "the fork server ended before its child"
        self.returncode = json.loads(line)["returncode"]
        self._replies.close()
        self._conn.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Read stdout (and stderr) to the end and wait for the exit, as ``Popen.communicate``; the timeout bounds
        a hang (the child is started already: no import is on this clock)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = [s for s in (self.stdout, self.stderr) if s is not None]
        texts: dict[int, str] = {}
        readers = [threading.Thread(target=lambda i, s: texts.__setitem__(i, s.read() if not s.closed else ""),
                                    args=(i, s), daemon=True) for i, s in enumerate(streams)]
        for r in readers:
            r.start()
        for r in readers:
            r.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if r.is_alive():
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0)
        for s in streams:
            s.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()) + 5)
        return texts.get(0, ""), (texts.get(1, "") if self.stderr is not None else None)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


def spawn(*, script: str | None = None, code: str | None = None, args: list[str] = (),  # type: ignore[assignment]
          cwd: str | None = None, merge_stderr: bool = False) -> Child:
    """``python script args...`` or ``python -c code args...``, forked from the server, in ``cwd``."""
    assert (script is None) != (code is None)
    request = {"script": script, "code": code, "args": [str(a) for a in args], "cwd": cwd or os.getcwd(),
               "env": dict(os.environ)}
    return Child(request, merge_stderr)


def signalled(proc: Child, signals: list[tuple[str, int]], timeout: float = 120,
              sent: Callable[[], None] | None = None) -> str:
    """Send each signal of ``signals`` to ``proc`` at the first line of its output (stdout with stderr merged) that
    starts with the signal's text, in order (calling ``sent()`` after each: the signal is the child's by then);
    then its whole output once it has ended (killed if anything fails)."""
    try:
        lines: list[str] = []
        pending = list(signals)
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if pending and line.startswith(pending[0][0]):
                proc.send_signal(pending.pop(0)[1])
                if sent is not None:
                    sent()
                if not pending:
                    break
        return "".join(lines) + proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
