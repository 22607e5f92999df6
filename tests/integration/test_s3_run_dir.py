"""A 2-node job whose run directory is on S3: a worker killed after a snapshot, herd restarts
the job, the Trainer resumes from the S3 snapshot, and every step's loss equals an
uninterrupted run's. The S3 server is moto's, a real HTTP server on the testbed bridge
address, which the nodes reach from their namespaces; credentials go to the nodes through
herd's env_file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.herd_cli import SCRIPTS
from tests.integration.training import ARGS, losses, worker_on
from tests.s3server import S3Server, make_bucket, s3_server
from tests.testbed import Testbed

# Its fixture is built once per module: xdist keeps the module's tests on one worker.
pytestmark = pytest.mark.xdist_group("s3_run_dir")


@pytest.fixture(scope="module")
def bridge_s3(testbed: Testbed) -> Iterator[S3Server]:
    pytest.importorskip("s3fs")
    assert testbed.subnet is not None
    bridge = str(next(iter(testbed.subnet.hosts())))  # the root namespace, seen from the nodes
    with s3_server(host=bridge) as server:
        make_bucket(server, "runs")
        yield server


def launch(
    testbed: Testbed, tmp_path: Path, server: S3Server, run_dir: str
) -> tuple[subprocess.Popen[str], Path]:
    home = tmp_path / "home"
    home.mkdir(parents=True)
    secrets = tmp_path / "aws.env"  # as a user keeps keys: a file, sent over ssh's stdin
    secrets.write_text("".join(f"{k}={v}\n" for k, v in server.env.items()))
    secrets.chmod(0o600)
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[{"host": "node1", "nproc": 1}, {"host": "node2", "nproc": 1}],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
        env_file=str(secrets),
    )
    argv = [sys.executable, "-m", "torchherd", "launch", "-c", str(path), "--max-restarts", "1"]
    process = subprocess.Popen(
        [*argv, "slow_minimal.py", *ARGS, "--run-dir", run_dir],
        cwd=SCRIPTS,
        env=dict(os.environ, HERD_HOME=str(home)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, home


def test_killed_worker_resumes_from_s3_to_the_same_loss(
    testbed: Testbed,
    bridge_s3: S3Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    uninterrupted_losses: list[tuple[int, float]],
) -> None:
    import s3fs

    for key, value in bridge_s3.env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    prefix = f"runs/{uuid.uuid4().hex[:8]}"
    process, home = launch(testbed, tmp_path / "killed", bridge_s3, f"s3://{prefix}")
    try:
        deadline = time.monotonic() + 180
        while not fs.exists(f"{prefix}/snapshots/step-40/manifest.json"):
            assert time.monotonic() < deadline and process.poll() is None, "no snapshot in time"
            fs.invalidate_cache()
            time.sleep(0.2)
        job_id = next((home / "jobs").iterdir()).name
        victim = worker_on(job_id, "node2", testbed)
        assert victim is not None, "no worker on node2"
        os.kill(victim, signal.SIGKILL)
        out = process.communicate(timeout=300)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, out
    assert "resumed from s3://" in out, out
    assert bridge_s3.env["AWS_SECRET_ACCESS_KEY"] not in out  # secrets stay out of the log

    fs.invalidate_cache()
    remote = tmp_path / "remote-metrics"
    remote.mkdir()
    (remote / "metrics.jsonl").write_bytes(fs.cat_file(f"{prefix}/metrics.jsonl"))
    # Each step once, every loss the uninterrupted run's (a restart from step 0 would also end
    # at the same final loss, but not without "resumed from" and the steps logged once).
    assert losses(remote) == uninterrupted_losses
