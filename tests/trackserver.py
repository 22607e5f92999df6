"""A real MLflow tracking server for tests and benchmarks, behind a proxy that can misbehave.

``mlflow server`` (SQLite store, loopback) runs as a separate process; clients talk to it through
``FaultyProxy``, a small HTTP forwarder on loopback whose mode the test sets: ``ok`` forwards
(after ``delay`` seconds: a slow server), ``hold`` keeps requests waiting without an answer (a
server that hangs), ``fail`` answers 503 to everything (a server that is down). Requests held
are answered when the mode changes. Only the failure is staged; the client and the server are
MLflow's own.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.ports import free_port


@contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """Run ``mlflow server`` with its store in ``folder``; yield its URL."""
    try:
        import mlflow.server  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("the mlflow server is not installed (pip install -e '.[dev]')")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(folder / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{folder / 'mlflow.db'}",
            "--default-artifact-root",
            (folder / "artifacts").as_uri(),
        ],  # fmt: skip
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    text = (folder / "server.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"mlflow server did not start on {url}:\n{text}") from None
                time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()


class FaultyProxy:
    """Forwards HTTP requests to ``backend``, as slowly or as badly as ``mode`` says."""

    def __init__(self, backend: str, delay: float = 0.0, mode: str = "ok") -> None:
        self.backend = backend.removeprefix("http://")
        self.delay = delay
        self._mode = mode
        self._changed = threading.Condition()
        self.requests = 0
        self.answered = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _any  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        with self._changed:
            self._mode = value
            self._changed.notify_all()

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else None
        with self._changed:
            self.requests += 1
            while self._mode == "hold":
                self._changed.wait()
            mode = self._mode
        if mode == "fail":
            self._answer(request, 503, b'{"error_code": "TEMPORARILY_UNAVAILABLE"}', {})
            return
        time.sleep(self.delay)
        connection = http.client.HTTPConnection(self.backend, timeout=60)
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        connection.request(request.command, request.path, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
        passed = {
            k: v
            for k, v in response.getheaders()
            if k.lower() not in ("content-length", "transfer-encoding", "connection")
        }
        connection.close()
        self._answer(request, response.status, data, passed)
        with self._changed:
            self.answered += 1

    @staticmethod
    def _answer(
        request: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str]
    ) -> None:
        request.send_response(status)
        for key, value in headers.items():
            request.send_header(key, value)
        if not any(key.lower() == "content-type" for key in headers):
            request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def close(self) -> None:
        self.mode = "fail"  # answer whatever is held
        self.server.shutdown()
        self.server.server_close()
