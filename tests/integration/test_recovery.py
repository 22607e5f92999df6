"""Recovery on the testbed: real faults injected into a running job, and what herd does.

A frozen rank (SIGSTOP), a node cut off (its link down), a silent drop of its traffic
(iptables DROP), a SIGKILLed agent, the loss of the rendezvous host with --min-nodes, and a
crash loop. Each test asserts the time herd took to notice (a generous bound: the machine is
shared), the node and rank it named, the evidence it kept, and that nothing of the job is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.integration.herd_cli import SCRIPTS
from tests.integration.herd_cli import one_worker_cluster as cluster
from tests.testbed import Testbed

# Generous bounds for the 2-core test machine; herd's own targets are 15 s and 60 s.
NODE_LOSS_BOUND = 25.0
HANG_BOUND = 40.0


class LiveHerd:
    """`herd launch` as a running process whose output lines are read as they come."""

    def __init__(self, args: list[str], home: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self._seen = threading.Condition()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torchherd", "launch", *args],
            cwd=SCRIPTS,
            env=dict(os.environ, HERD_HOME=str(home), PYTHONUNBUFFERED="1"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._seen:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._seen.notify_all()

    def wait_for(self, pattern: str, timeout: float, count: int = 1) -> list[re.Match[str]]:
        """The first ``count`` matches of ``pattern``; fails with the output after timeout."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._seen:
            while True:
                found = [m for _, line in self.lines if (m := regex.search(line))]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                assert left > 0 and self.process.poll() is None or len(found) >= count, (
                    f"{pattern!r} not seen {count} time(s) in {timeout:g} s:\n{self.output}"
                )
                self._seen.wait(min(left, 0.5) if left > 0 else 0.5)

    def seen_at(self, pattern: str) -> float | None:
        regex = re.compile(pattern)
        return next((t for t, line in self.lines if regex.search(line)), None)

    def finish(self, timeout: float = 120) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)


def job_id(home: Path) -> str:
    return next((home / "jobs").iterdir()).name


def pids(match: re.Match[str]) -> int:
    return int(match.group("pid"))


def assert_nothing_left(testbed: Testbed, job: str, within: float = 30.0) -> None:
    """No process of the job anywhere (namespaces share the pid space), and no ssh client or
    control master of this launcher left either."""
    deadline = time.monotonic() + within
    left = testbed.processes_with_env("HERD_JOB_ID", job)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = testbed.processes_with_env("HERD_JOB_ID", job)
    assert not left, f"processes of job {job} still running: {left}"


def stacks_of(home: Path, job: str) -> dict[str, str]:
    found = {}
    for path in (home / "jobs" / job / "stacks").rglob("*-rank-*.txt"):
        found[path.name] = path.read_text()
    return found


def test_frozen_rank_is_named_with_its_stacks(testbed: Testbed, tmp_path: Path) -> None:
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(
        ["-c", str(path), "--hang-timeout", "6", "--grace", "3", "steps.py", "--quiet"], home
    )
    stepping = herd.wait_for(r"STEPPING rank=(?P<rank>\d) pid=(?P<pid>\d+)", 120, count=2)
    victim = next(m for m in stepping if m.group("rank") == "1")
    frozen_at = time.monotonic()
    os.kill(pids(victim), signal.SIGSTOP)
    try:
        herd.wait_for(r"the job is hung", HANG_BOUND)
        noticed = (herd.seen_at("the job is hung") or 0) - frozen_at
        code = herd.finish()
    finally:
        try:
            os.kill(pids(victim), signal.SIGCONT)
        except ProcessLookupError:
            pass
    out = herd.output
    assert code == 1, out
    assert noticed <= HANG_BOUND, f"hang noticed after {noticed:.1f} s"
    assert re.search(r"node2 rank 1: stopped \(state T", out), out
    assert "first failure: node2 rank 1" in out, out
    job = job_id(home)
    stacks = stacks_of(home, job)
    assert "node2-rank-1.txt" in stacks and "state T" in stacks["node2-rank-1.txt"], stacks
    assert "all_reduce" in stacks.get("node1-rank-0.txt", ""), stacks
    summary = json.loads(next((home / "jobs" / job / "stacks").rglob("summary.json")).read_text())
    assert summary["behind"][0]["rank"] == 1
    shown = subprocess.run(
        [sys.executable, "-m", "torchherd", "logs", job, "--stacks"],
        env=dict(os.environ, HERD_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0 and "state T" in shown.stdout, shown.stdout + shown.stderr
    assert_nothing_left(testbed, job)


def test_node_cut_off_is_noticed_by_the_launcher_and_its_agent(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    testbed = clean_faults
    # The agents wait 15 s (not the default 90) for a launcher they no longer hear.
    path, home = cluster(testbed, tmp_path, ["node2", "node3"], launcher_silence=15)
    herd = LiveHerd(["-c", str(path), "--grace", "3", "steps.py"], home)
    herd.wait_for(r"STEPPING rank=1", 120)
    job = job_id(home)
    cut_at = time.monotonic()
    testbed.partition("node3")
    herd.wait_for(r"node3 stopped answering at \d\d:\d\d:\d\d \(network or machine down\)", 40)
    noticed = (herd.seen_at("node3 stopped answering") or 0) - cut_at
    code = herd.finish()
    out = herd.output
    assert code == 1, out
    assert noticed <= NODE_LOSS_BOUND, f"node loss noticed after {noticed:.1f} s"
    assert "first failure: node3: node3 stopped answering" in out, out
    assert "herd doctor" in out  # the remedy fits a lost node, not an ssh failure
    assert "ssh -v" not in out
    # The cut-off node's own agent ends its share of the job (it hears no launcher).
    deadline = cut_at + 40
    while time.monotonic() < deadline:
        on_node3 = [
            pid
            for pid in testbed.processes_with_env("HERD_JOB_ID", job)
            if b"HERD_NODE=node3" in Path(f"/proc/{pid}/environ").read_bytes()
        ]
        if not on_node3:
            break
        time.sleep(0.5)
    assert not on_node3, f"the agent on node3 left {on_node3} running"
    testbed.heal("node3")
    assert_nothing_left(testbed, job)


def test_silent_drop_of_a_nodes_traffic_is_a_lost_node(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    testbed = clean_faults
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(["-c", str(path), "--grace", "3", "steps.py"], home)
    herd.wait_for(r"STEPPING rank=1", 120)
    dropped_at = time.monotonic()
    testbed.block_port("node2", 22)  # the launcher's ssh link to node2: packets vanish
    herd.wait_for(r"node2 stopped answering", 40)
    noticed = (herd.seen_at("node2 stopped answering") or 0) - dropped_at
    code = herd.finish()
    assert code == 1, herd.output
    assert noticed <= NODE_LOSS_BOUND, f"silent drop noticed after {noticed:.1f} s"
    testbed.unblock_port("node2", 22)
    assert_nothing_left(testbed, job_id(home), within=40)


def test_killed_agent_is_lost_and_its_processes_swept(testbed: Testbed, tmp_path: Path) -> None:
    path, home = cluster(testbed, tmp_path, ["node1", "node2", "node3"])
    herd = LiveHerd(["-c", str(path), "--grace", "3", "steps.py"], home)
    herd.wait_for(r"STEPPING rank=2", 120)
    job = job_id(home)
    agent = json.loads((home / "nodes" / job / "node2" / "agent.json").read_text())["pid"]
    os.kill(agent, signal.SIGKILL)
    herd.wait_for(r"node2 failed; stopping the other nodes", NODE_LOSS_BOUND)
    code = herd.finish()
    out = herd.output
    assert code == 1, out
    assert "first failure: node2" in out and "lost contact with node2" in out, out
    assert_nothing_left(testbed, job)


def test_rendezvous_host_lost_job_goes_on_with_fewer_nodes(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    testbed = clean_faults
    path, home = cluster(testbed, tmp_path, ["node1", "node2", "node3"])
    run_dir = tmp_path / "run"
    args = ["--max-steps", "150", "--snapshot-every", "20", "--batch-size", "16"]
    herd = LiveHerd(
        [
            "-c",
            str(path),
            "--max-restarts",
            "1",
            "--min-nodes",
            "2",
            "--grace",
            "3",
            "slow_minimal.py",
            *args,
            "--run-dir",
            str(run_dir),
        ],
        home,
    )
    deadline = time.monotonic() + 150
    while not (run_dir / "snapshots" / "step-40").exists():
        assert time.monotonic() < deadline and herd.process.poll() is None, herd.output
        time.sleep(0.1)
    job = job_id(home)
    lost_at = time.monotonic()
    testbed.partition("node1")
    herd.wait_for(r"node1 stopped answering", 40)
    herd.wait_for(r"going on without node1: 2 node\(s\) left, rendezvous now on node2", 60)
    resumed = herd.wait_for(r"resumed from .*step-(\d+)", 120)[0]
    resumed_after = (herd.seen_at(r"resumed from") or 0) - lost_at
    code = herd.finish(timeout=240)
    out = herd.output
    assert code == 0, out
    assert int(resumed.group(1)) >= 40, out
    assert resumed_after <= 120, f"training resumed {resumed_after:.0f} s after the loss"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r and "step" in r]
    assert steps[-1] == 150 and len(steps) == len(set(steps)), steps
    assert re.search(r"world size 2", out) or "after 1 restart" in out, out
    testbed.heal("node1")
    assert_nothing_left(testbed, job)


def test_crash_loop_stops_early_with_its_own_exit_code(testbed: Testbed, tmp_path: Path) -> None:
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(
        [
            "-c",
            str(path),
            "--max-restarts",
            "10",
            "--crash-loop",
            "2",
            "steps.py",
            "--fail-rank",
            "1",
        ],
        home,
    )
    code = herd.finish(timeout=300)
    out = herd.output
    assert code == 4, out
    assert re.search(r"gave up: crash loop: 2 restart\(s\) in a row failed", out), out
    assert "after 2 restart(s)" in out, out
    assert "restart 3 of 10" not in out
    assert_nothing_left(testbed, job_id(home))
