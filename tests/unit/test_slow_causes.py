"""What a node can tell about a slow rank (agent.slow), on real processes and a real cgroup:
a worker held to 10 % of a CPU by its cgroup's quota, and one that keeps being stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchherd.agent.slow import cgroup_dirs, likely_causes, quota

BUSY = "import time\nwhile True:\n    sum(range(10000))\n"


@pytest.fixture
def busy_worker() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A CPU-bound process tagged like rank 0 of a job on node n1."""
    job = f"slow-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, HERD_JOB_ID=job, HERD_NODE="n1", HERD_ATTEMPT="0")
    env.update(RANK="0", LOCAL_RANK="0")
    worker = subprocess.Popen([sys.executable, "-c", BUSY], env=env)
    try:
        time.sleep(0.3)
        yield worker, job
    finally:
        worker.kill()
        worker.wait()


def cpu_cgroup() -> Path:
    """A fresh CPU cgroup of this machine's hierarchy (v1 or v2)."""
    name = f"herd-test-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    for root in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct")):
        if (root / "cpu.cfs_quota_us").exists():
            return root / name
    unified = Path("/sys/fs/cgroup")
    if "cpu" in (unified / "cgroup.controllers").read_text().split():
        return unified / name
    raise AssertionError("no CPU cgroup controller here: this test needs root and cgroups")


def test_a_cpu_quota_is_named_with_its_size(busy_worker) -> None:  # type: ignore[no-untyped-def]
    worker, job = busy_worker
    group = cpu_cgroup()
    group.mkdir()
    try:
        if (group / "cpu.cfs_quota_us").exists():
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text("10000")
        else:
            (group / "cpu.max").write_text("10000 100000")
        (group / "cgroup.procs").write_text(str(worker.pid))
        assert str(group) in [str(Path(d)) for d in cgroup_dirs(worker.pid)]
        assert quota(str(group)) == "10% of a CPU"
        causes = likely_causes(job, "n1", "0", 0)
        assert any(c == "CPU throttled by its cgroup (quota 10% of a CPU)" for c in causes), causes
    finally:
        worker.kill()
        worker.wait()
        group.rmdir()


def test_a_worker_that_keeps_being_stopped_is_said_to_be(busy_worker) -> None:  # type: ignore[no-untyped-def]
    worker, job = busy_worker
    done = threading.Event()

    def duty_cycle() -> None:  # stopped half of the time
        while not done.is_set():
            os.kill(worker.pid, signal.SIGSTOP)
            time.sleep(0.2)
            os.kill(worker.pid, signal.SIGCONT)
            time.sleep(0.2)

    thread = threading.Thread(target=duty_cycle, daemon=True)
    thread.start()
    try:
        seen = [likely_causes(job, "n1", "0", 0) for _ in range(3)]
    finally:
        done.set()
        thread.join()
        os.kill(worker.pid, signal.SIGCONT)
    assert any("it was stopped (state T" in c for causes in seen for c in causes), seen


def test_a_balanced_worker_has_no_cause(busy_worker) -> None:  # type: ignore[no-untyped-def]
    _, job = busy_worker
    causes = likely_causes(job, "n1", "0", 0)
    assert not [c for c in causes if "throttled" in c or "stopped" in c], causes
