"""moto's S3 server on 127.0.0.1 for the session, the environment that finds it, and a proxy in front of it that
can fail chosen requests (tests/format/test_remote_storage.py and the S3 tests that reuse them)."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_command(port: int) -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if os.path.exists(script):
        return [script, "-H", "127.0.0.1", "-p", str(port)]
    return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on a free loopback port, for the whole session."""
    port = _free_port()
    server = subprocess.Popen(_moto_command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # moto's start-up (imports) on a loaded machine: only a hang fails
        while True:
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on {url}") from None
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _s3_env(endpoint: str) -> dict[str, str]:
    """How a process without storage_options finds the server: s3fs (botocore) reads these."""
    return {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint}


class _Proxy(ThreadingHTTPServer):
    """Forwards each request to moto, on 127.0.0.1, except that it answers HTTP 500 to the methods in ``failing``."""

    daemon_threads = True

    def __init__(self, upstream_port: int) -> None:
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream_port = upstream_port
        self.failing: set[str] = set()
        self.failed: list[str] = []  # "METHOD path" of each request answered 500
        self.requests: list[str] = []  # "METHOD path" of every request, in order (tests count reads)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Proxy

    def _forward(self) -> None:
        body = self._body()
        self.server.requests.append(f"{self.command} {self.path}")
        if self.command in self.server.failing:
            self.server.failed.append(f"{self.command} {self.path}")
            self._answer(500, [("Content-Type", "application/xml")],
                         b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
                         b"<Message>injected by the test</Message></Error>")
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "transfer-encoding")}
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            self._answer(response.status, response.getheaders(), response.read())
        finally:
            upstream.close()

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _answer(self, status: int, headers: list[tuple[str, str]], payload: bytes) -> None:
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in ("connection", "transfer-encoding", "content-length", "date", "server"):
                self.send_header(k, v)
        length = dict((k.lower(), v) for k, v in headers).get("content-length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def proxy(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Proxy]:
    for name, value in _s3_env(s3_endpoint).items():
        monkeypatch.setenv(name, value)
    server = _Proxy(int(s3_endpoint.rsplit(":", 1)[1]))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def counted(proxy: _Proxy, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Proxy]:
    """The proxy, which what opens the store without our options reaches too (the environment names it); fsspec's
    cached S3 file systems are dropped before and after, so none made here outlives the proxy."""
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield proxy
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
