"""Detached jobs on the testbed: `herd launch --detach`, then ps, logs, top and stop from other
processes, with the launcher long gone; and `herd stop` of an attached job from another terminal."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.integration.herd_cli import herd
from tests.integration.procs import cmdline
from tests.testbed import Testbed

JOB = """\
import os, time
rank = int(os.environ["RANK"])
print(f"hello from rank {rank}", flush=True)
for step in range(1, 100000):
    if rank == 0 or step % 10 == 0:
        print(f"step {step}", flush=True)
    time.sleep(0.1)
"""


def setup(testbed: Testbed, tmp_path: Path) -> tuple[Path, Path, Path]:
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    (project / "job.py").write_text(JOB)
    config = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[{"host": "node1", "nproc": 2}, "node2"],
        workdir=str(project),
        env={"HERD_HOME": str(home)},
    )
    return project, home, config


def wait_for(predicate: Callable[[], bool], timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def job_id_of(stdout: str) -> str:
    for word in stdout.split():
        if word.count("-") == 2 and word[:4].isdigit():
            return word
    raise AssertionError(f"no job id in {stdout!r}")


def test_detached_job_survives_the_launcher_and_is_stopped_from_another_process(
    testbed: Testbed, tmp_path: Path
) -> None:
    project, home, config = setup(testbed, tmp_path)
    os.umask(0o022)  # the usual umask, which herd must not rely on
    started = time.monotonic()
    launched = herd(["launch", "-c", str(config), "--detach", "job.py"], home, project)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert time.monotonic() - started < 60
    job = job_id_of(launched.stdout)
    assert f"herd logs {job} -f" in launched.stdout
    # The launcher has exited; the job runs on, on both nodes.
    for node in ("node1", "node2"):
        assert testbed.processes_with_env("HERD_NODE", node)
    assert len(testbed.processes_with_env("HERD_JOB_ID", job)) >= 2  # torchrun on each node
    events = home / "nodes" / job / "node1" / "events.jsonl"
    wait_for(lambda: events.exists() and "step 20" in events.read_text(), what="rank 0 steps")
    assert len(testbed.processes_with_env("HERD_JOB_ID", job)) >= 5  # + 3 workers
    # The nodes' files hold the job's output: private, whatever the umask (022 here).
    for node in ("node1", "node2"):
        for name in ("events.jsonl", "agent.log"):
            path = home / "nodes" / job / node / name
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, (path, oct(path.stat().st_mode))

    ps = json.loads(herd(["ps", "--json"], home, project).stdout)
    row = next(r for r in ps if r["id"] == job)
    assert (row["state"], row["detached"], row["nodes"], row["world_size"]) == (
        "running",
        True,
        ["node1", "node2"],
        3,
    )
    table = herd(["ps"], home, project).stdout
    assert any(line.startswith(job) and "running (detached)" in line for line in table.splitlines())

    logs = herd(["logs", job], home, project)
    assert logs.returncode == 0, logs.stderr
    for rank, node in ((0, "node1"), (1, "node1"), (2, "node2")):
        assert f"{node}:{rank} | hello from rank {rank}" in logs.stdout
    only = herd(["logs", job[:-2], "--rank", "2"], home, project).stdout.splitlines()
    assert only[0] == "hello from rank 2" and set(only[1:]) <= {f"step {i}" for i in range(99999)}

    top = herd(["top", "-c", str(config), "--once"], home, project)
    rows = [line.split() for line in top.stdout.splitlines()[1:] if line.strip()]
    assert [r[0] for r in rows] == ["node1", "node2"]
    assert all(job in r for r in rows) and "step" in top.stdout

    follower = subprocess.Popen(
        [sys.executable, "-m", "torchherd", "logs", job, "-f"],
        cwd=project,
        env=dict(os.environ, HERD_HOME=str(home)),
        stdout=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(60, follower.kill)  # reading has no timeout of its own
    watchdog.start()
    try:
        assert follower.stdout is not None
        first = follower.stdout.readline()  # the follower is attached and printing
        assert first, "herd logs -f printed nothing"
        stop = herd(["stop", job], home, tmp_path)  # another process, another directory
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert f"job {job} stopped on every node" in stop.stdout
        assert testbed.processes_with_env("HERD_JOB_ID", job) == []
        followed = first + follower.stdout.read()  # -f ends with the job
        follower.wait(timeout=10)
    finally:
        watchdog.cancel()
        follower.kill()
    assert follower.returncode == 0
    assert "node1   | herd: job ended on node1 (stopped)" in followed
    assert "node2   | herd: job ended on node2 (stopped)" in followed
    row = next(
        r for r in json.loads(herd(["ps", "--json"], home, project).stdout) if r["id"] == job
    )
    assert row["state"] == "stopped" and row["exit_code"] == 130


def test_stop_from_another_terminal_ends_an_attached_job(testbed: Testbed, tmp_path: Path) -> None:
    project, home, config = setup(testbed, tmp_path)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torchherd", "launch", "-c", str(config), "job.py"],
        cwd=project,
        env=dict(os.environ, HERD_HOME=str(home)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        jobs = home / "jobs"
        wait_for(lambda: jobs.is_dir() and any(jobs.iterdir()), what="the job record")
        job = next(jobs.iterdir()).name
        # The launcher's own files are flushed in blocks; the node's torchrun log is not.
        pattern = f"nodes/{job}/node1/attempt-0/torchrun/*/attempt_0/0/stdout.log"
        wait_for(lambda: any("step 5" in p.read_text() for p in home.glob(pattern)), what="steps")
        stop = herd(["stop", job], home, tmp_path)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        output, _ = launcher.communicate(timeout=60)  # the launcher sees its agents end
    finally:
        launcher.kill()
    assert testbed.processes_with_env("HERD_JOB_ID", job) == []
    assert "node1  stopped" in output and "node2  stopped" in output
    assert f"job {job} interrupted" in output and "first failure" not in output
    assert launcher.returncode == 130
    record = json.loads((jobs / job / "job.json").read_text())
    assert record["state"] == "stopped"
    logs = herd(["logs", job, "--rank", "0"], home, project).stdout.splitlines()
    assert logs[0] == "hello from rank 0" and "step 5" in logs


def test_unknown_job_is_a_usage_error(tmp_path: Path) -> None:
    for verb in ("stop", "logs"):
        out = herd([verb, "no-such-job"], tmp_path, tmp_path)
        assert out.returncode == 2 and "no job 'no-such-job'" in out.stderr
        assert "Traceback" not in out.stderr


def test_stopping_one_of_two_jobs_on_the_same_nodes_spares_the_other(
    testbed: Testbed, tmp_path: Path
) -> None:
    """Two detached jobs share node1 and node2 (same script, same user): `herd stop` of one
    ends exactly its processes, found by job id, never by name."""
    project, home, config = setup(testbed, tmp_path)
    jobs = []
    for _ in range(2):
        launched = herd(["launch", "-c", str(config), "--detach", "job.py"], home, project)
        assert launched.returncode == 0, launched.stdout + launched.stderr
        jobs.append(job_id_of(launched.stdout))
    first, second = jobs
    assert first != second
    for job in jobs:
        events = home / "nodes" / job / "node2" / "events.jsonl"
        wait_for(lambda e=events: e.exists() and "step 20" in e.read_text(), what=f"{job} steps")
    spared = set(testbed.processes_with_env("HERD_JOB_ID", second))
    assert len(spared) >= 5  # torchrun on each node and 3 workers
    try:
        assert herd(["stop", first], home, project).returncode == 0
        wait_for(
            lambda: not testbed.processes_with_env("HERD_JOB_ID", first), what=f"{first} to end"
        )
        # Every process of the other job is still the same process, still running, and still
        # making progress.
        assert set(testbed.processes_with_env("HERD_JOB_ID", second)) == spared
        events = home / "nodes" / second / "node1" / "events.jsonl"
        size = events.stat().st_size
        wait_for(lambda: events.stat().st_size > size, what=f"{second} to go on printing")
        ps = {r["id"]: r["state"] for r in json.loads(herd(["ps", "--json"], home, project).stdout)}
        assert ps[second] == "running" and ps[first] != "running", ps
    finally:
        assert herd(["stop", second], home, project).returncode == 0
    wait_for(lambda: not testbed.processes_with_env("HERD_JOB_ID", second), what="cleanup")


# A node's interpreter that is slow to start a detached job's agent: it says so (a marker
# file), then holds the agent back until the test lets it go (a release file), or drops it
# (an abandon file: the test is over, and an agent started now would run a job nobody waits
# for, beside the next test on the same testbed).
SLOW_START = """#!/bin/sh
case "$*" in *"torchherd.agent run"*)
    touch {marker}
    while [ ! -e {release} ]; do sleep 0.05; done
    [ -e {abandon} ] && exit 1 ;;
esac
exec {python} "$@"
"""


class SlowStart:
    """A detached launch on node1 (quick) and node2 (its agent held back by SLOW_START), with
    everything the launcher prints collected by a thread."""

    def __init__(self, testbed: Testbed, tmp_path: Path) -> None:
        project, self.home, _ = setup(testbed, tmp_path)
        self.marker, self.release = tmp_path / "starting", tmp_path / "release"
        self.abandon = tmp_path / "abandon"
        python = self.shim = tmp_path / "slow-python"
        python.write_text(
            SLOW_START.format(
                marker=self.marker,
                release=self.release,
                abandon=self.abandon,
                python=sys.executable,
            )
        )
        python.chmod(0o755)
        config = testbed.write_cluster_file(
            tmp_path / "slow.toml",
            nodes=["node1", {"host": "node2", "python": str(python)}],
            workdir=str(project),
            env={"HERD_HOME": str(self.home)},
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torchherd", "launch", "-c", str(config), "--detach", "job.py"],
            cwd=project,
            env=dict(os.environ, HERD_HOME=str(self.home)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def job_id(self) -> str:
        match = re.search(r"herd \S+: job (\S+) on", self.output)
        assert match, self.output
        return match.group(1)

    def interrupt_while_node2_starts(self) -> None:
        """Ctrl-C once node1 has started the job and node2's start is on its way."""
        wait_for(self.marker.exists, what="node2's agent to be starting")
        wait_for(lambda: self.node_started("node1"), what="the job on node1")
        self.process.send_signal(signal.SIGINT)
        wait_for(lambda: "once each has answered" in self.output, what="herd to say it waits")

    def node_started(self, node: str) -> bool:
        """The node's detached agent said "started" (its torchrun then waits for the other
        node at the rendezvous)."""
        if "job " not in self.output:
            return False
        events = self.home / "nodes" / self.job_id() / node / "events.jsonl"
        return events.exists() and '"e":"started"' in events.read_text()

    def finish(self, timeout: float = 120) -> int:
        code = self.process.wait(timeout=timeout)
        self._reader.join(10)
        return code

    def close(self, testbed: Testbed) -> None:
        # An agent still held back is dropped, not let go: let go after the test, it started a
        # job on node2 whose torchrun waited for node1 at the rendezvous for good, and the next
        # test on this testbed found it running (it began after that test's first look).
        self.abandon.touch()
        self.release.touch()
        if self.process.poll() is None:
            self.process.kill()
        shim = str(self.shim).encode()
        wait_for(
            lambda: (
                not [
                    pid
                    for node in testbed.nodes
                    for pid in testbed.node_processes(node)
                    if shim in (cmdline(pid) or b"")
                ]
            ),
            timeout=10,
            what="the held-back agent's start to give up",
        )
        # Whatever a test left (a failing one): its own job's processes, by job id.
        if "job " in self.output:
            for pid in testbed.processes_with_env("HERD_JOB_ID", self.job_id()):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_ctrl_c_during_a_detached_start_stops_the_job_on_every_node(
    testbed: Testbed, tmp_path: Path
) -> None:
    start = SlowStart(testbed, tmp_path)
    try:
        start.interrupt_while_node2_starts()
        start.release.touch()  # node2 answers after the Ctrl-C: its job is stopped too
        code = start.finish()
        job = start.job_id()
        assert code == 130, start.output
        assert "interrupted while the job was starting; it was stopped on every node" in (
            start.output
        )
        assert "Traceback" not in start.output
        assert testbed.processes_with_env("HERD_JOB_ID", job) == []
        assert start.node_started("node2"), "node2 never started: nothing was proven there"
        wait_for(
            lambda: not any(testbed.node_processes(n) for n in testbed.nodes),
            timeout=10,
            what="the nodes' ssh sessions to end",
        )
    finally:
        start.close(testbed)


def test_a_second_ctrl_c_stops_waiting_and_still_sweeps_the_nodes(
    testbed: Testbed, tmp_path: Path
) -> None:
    start = SlowStart(testbed, tmp_path)
    try:
        start.interrupt_while_node2_starts()
        start.process.send_signal(signal.SIGINT)  # node2 has not answered, and never will
        code = start.finish(timeout=60)
        job = start.job_id()
        assert code == 130, start.output
        assert "herd: stopping the job on every node" in start.output
        assert "Traceback" not in start.output
        # node1 had started the job: it was swept, although node2 never answered.
        on_node1 = set(testbed.processes_with_env("HERD_NODE", "node1"))
        assert not on_node1 & set(testbed.processes_with_env("HERD_JOB_ID", job))
    finally:
        start.close(testbed)
