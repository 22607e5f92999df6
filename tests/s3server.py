"""A real S3 server for tests: moto in server mode, as a separate process on a chosen address.

s3fs's own test suite runs against the same server. Tests point boto at it the standard way,
``AWS_ENDPOINT_URL`` and dummy credentials in the environment, so the code under test takes
no test-only arguments.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from tests.ports import free_port


@dataclass(frozen=True)
class S3Server:
    """A running moto server: its endpoint and the environment that points boto at it."""

    endpoint: str

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }


@contextmanager
def s3_server(host: str = "127.0.0.1") -> Iterator[S3Server]:
    """Start moto's S3 server on ``host`` and stop it afterwards; skip if moto is missing."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("moto[server] is not installed (pip install -e '.[dev]')")
    port = free_port(host)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    endpoint = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on {endpoint}") from None
                time.sleep(0.2)
        yield S3Server(endpoint)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_bucket(server: S3Server, name: str) -> None:
    """Create a bucket on the server."""
    req = urllib.request.Request(f"{server.endpoint}/{name}", method="PUT")
    urllib.request.urlopen(req, timeout=10).close()
