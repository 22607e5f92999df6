"""What a node can tell about a slow rank (agent.slow), on real processes and a real cgroup:
a worker held to 10 % of a CPU by its cgroup's quota, one that keeps being stopped, one that
shares its CPU with a busy process (named by pid); and the judge on a table of evidence."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchherd.agent.slow import (
    Competitor,
    Evidence,
    cgroup_dirs,
    gather,
    judge,
    likely_causes,
    quota,
)

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


def test_a_worker_stopped_a_fifth_of_every_second_is_said_to_be(busy_worker) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP for 0.2 s, SIGCONT for 0.8 s, over and over: a 1.25x slowdown whose process is
    running at most moments. One look (a 2-s window) sees it, with about the right share."""
    worker, job = busy_worker
    done = threading.Event()

    def duty_cycle() -> None:
        while not done.is_set():
            os.kill(worker.pid, signal.SIGSTOP)
            time.sleep(0.2)
            os.kill(worker.pid, signal.SIGCONT)
            time.sleep(0.8)

    thread = threading.Thread(target=duty_cycle, daemon=True)
    thread.start()
    try:
        causes = likely_causes(job, "n1", "0", 0)
    finally:
        done.set()
        thread.join()
        os.kill(worker.pid, signal.SIGCONT)
    said = [
        m for c in causes if (m := re.search(r"it was stopped (\d+)% of the time \(state T", c))
    ]
    assert said, causes
    assert 8 <= int(said[0].group(1)) <= 40, causes


def test_a_balanced_worker_has_no_cause(busy_worker) -> None:  # type: ignore[no-untyped-def]
    _, job = busy_worker
    causes = likely_causes(job, "n1", "0", 0)
    assert not [c for c in causes if "throttled" in c or "stopped" in c], causes


# ---------------------------------------------------------------- the judge, on evidence

QUOTA_BITES = Evidence(window=2.0, throttled=0.3, quota="83% of a CPU", run_delay=0.5)
COMPETED = Evidence(
    window=2.0,
    run_delay=0.4,
    competitors=(Competitor("python3", 4242, 0.21),),
    pressure={"cpu": 30.0, "memory": 0.0, "io": 0.0},
)
CASES = [
    # (what the node showed, the causes said: substrings, in order; none for [])
    ("a quota that bites", QUOTA_BITES, ["CPU throttled by its cgroup (quota 83% of a CPU)"]),
    (
        "a process on its CPU",
        COMPETED,
        [
            "waiting for a CPU 20% of the time (CPU pressure 30%); competing for its CPU: "
            "python3 (pid 4242, 21% of a core)"
        ],
    ),
    (
        "run delay, nobody on the node to blame",
        Evidence(window=2.0, run_delay=0.4, pressure={"cpu": 40.0}),
        ["waiting for a CPU 20% of the time (CPU pressure 40%); no process on the node stands out"],
    ),
    # A throttled rank waits runnable too: the quota alone is the cause, unless a process
    # on the node is also there to blame.
    ("a quota, nobody else", QUOTA_BITES, ["CPU throttled by its cgroup"]),
    ("a quota that rarely bites", Evidence(window=2.0, throttled=0.02, quota="90% of a CPU"), []),
    ("a little run delay", Evidence(window=2.0, run_delay=0.15), []),
    (
        "a little run delay, a process to name",
        Evidence(window=2.0, run_delay=0.15, competitors=(Competitor("yes", 7, 0.5),)),
        ["waiting for a CPU 8% of the time; competing for its CPU: yes (pid 7, 50% of a core)"],
    ),
    ("nothing", Evidence(window=2.0), []),
    (
        "memory pressure and nothing else",
        Evidence(window=2.0, pressure={"cpu": 5.0, "memory": 25.0, "io": 3.0}),
        ["memory pressure on the node (25%)"],
    ),
    (
        "memory pressure beside a CPU cause: the CPU cause only",
        Evidence(window=2.0, throttled=0.5, pressure={"memory": 25.0}),
        ["CPU throttled by its cgroup"],
    ),
    ("stopped", Evidence(window=2.0, stopped=0.2), ["it was stopped 20% of the time (state T"]),
]


@pytest.mark.parametrize("seen, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_judge_says_only_what_the_evidence_shows(seen: Evidence, expected: list[str]) -> None:
    causes = judge(seen)
    assert len(causes) == len(expected), causes
    for cause, wanted in zip(causes, expected, strict=True):
        assert wanted in cause, causes


def test_a_process_competing_for_the_workers_cpu_is_named_by_pid() -> None:
    # A node of its own (a network namespace: what the agent takes for the node), so that
    # only this test's processes are on it: the worker, pinned to one CPU, and a busy
    # process on the same CPU.
    job = f"slow-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, HERD_JOB_ID=job, HERD_NODE="n1", HERD_ATTEMPT="0")
    env.update(RANK="0", LOCAL_RANK="0")
    cpu = str(sorted(os.sched_getaffinity(0))[-1])
    worker = subprocess.Popen(
        ["unshare", "--net", "taskset", "-c", cpu, sys.executable, "-c", BUSY], env=env
    )
    rival = None
    try:
        time.sleep(0.5)
        rival = subprocess.Popen(
            ["nsenter", "-t", str(worker.pid), "--net", "taskset", "-c", cpu, sys.executable]
            + ["-c", BUSY]
        )
        time.sleep(0.5)
        seen = gather(job, "n1", "0", 0)
        assert seen is not None
        assert [c.pid for c in seen.competitors] == [rival.pid], seen
        causes = judge(seen)
        assert any(f"(pid {rival.pid}," in c for c in causes), causes
        assert not [c for c in causes if "throttled" in c], causes
    finally:
        for process in (worker, rival):
            if process is not None:
                process.kill()
                process.wait()
