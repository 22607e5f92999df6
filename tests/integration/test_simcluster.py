"""The simulated cluster (tests/simcluster) behaves, for herd, as a cluster does.

Real node agents, SimulatedHosts as the transport, the torchrun stand-in for torch: herd's own
launch must see every rank's prefixed lines and step beats, name a failed rank as the first
failure, call a frozen node lost after its silence and stop the others, and leave nothing of
the job behind. bench/scale.py measures the launcher on it; this keeps it honest.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.simcluster import SimCluster
from tests.simcluster.standin import parent

# Runs alone (scripts/test): a frozen node must be named within 25 s on two loaded cores.
pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parents[2]


def launch(sim: SimCluster, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.simcluster.launcher", str(sim.root), "--grace", "3", *args],
        cwd=REPO,
        env=dict(os.environ, HERD_HOME=str(sim.home)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def job_record(sim: SimCluster) -> dict[str, object]:
    [job] = list((sim.home / "jobs").iterdir())
    return dict(json.loads((job / "job.json").read_text()))


def nothing_left(sim: SimCluster, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while sim.processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not sim.processes(), f"left running: {sim.processes()}"


def test_ranks_speak_and_beat_and_a_failed_rank_is_named(tmp_path: Path) -> None:
    sim = SimCluster(tmp_path / "sim", nodes=3, nproc=2).build(lines_per_second=4)
    process = launch(sim)
    try:
        assert len(sim.wait_events("run", 3, timeout=60)) == 3
        time.sleep(3)
        sim.set_control(lines_per_second=4, fail={"nodes": [1], "local_rank": 1, "exitcode": 7})
        out = process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, out
    for rank in range(6):
        assert re.search(rf"^sim{rank // 2}:{rank} +\| step \d+ loss", out, re.M), out
    assert "first failure: sim1 rank 3: exit code 7" in out
    assert "sim0  stopped" in out and "sim2  stopped" in out
    attempt = job_record(sim)["attempts"][0]  # type: ignore[index]
    assert attempt["max_step"] >= 3  # the stand-in's beats reached the launcher
    nothing_left(sim)


def test_a_frozen_node_is_called_lost_and_the_others_are_stopped(tmp_path: Path) -> None:
    sim = SimCluster(tmp_path / "sim", nodes=3, nproc=1).build()
    process = launch(sim)
    try:
        assert len(sim.wait_events("run", 3, timeout=60)) == 3
        sim.set_control(silent={"nodes": [2], "seconds": 25})
        [frozen] = sim.wait_events("silent", 1, timeout=10)
        out = process.communicate(timeout=120)[0]
        ended = time.time()
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1, out
    assert "herd: sim2 stopped answering" in out, out
    assert "sim2  lost" in out and "sim0  stopped" in out and "sim1  stopped" in out
    assert ended - frozen < 25  # the launcher did not wait for the frozen node to wake
    # Woken up, its agent finds its link cut and ends the job there too.
    nothing_left(sim, within=40)


def test_a_large_job_shows_rank_0_unless_every_rank_is_asked_for(tmp_path: Path) -> None:
    """Above 16 nodes the agents send rank 0's lines (and every stderr line); the others stay
    on their nodes. `--ranks all` is not the default there: it brings every rank's lines."""
    sim = SimCluster(tmp_path / "sim", nodes=17, nproc=1).build(lines_per_second=2)
    for ranks, shown in ((None, {0}), ("all", set(range(17)))):
        process = launch(sim, "--seconds", "4", *(["--ranks", ranks] if ranks else []))
        try:
            out = process.communicate(timeout=180)[0]
        finally:
            if process.poll() is None:
                process.kill()
        assert process.returncode == 0, out
        spoke = {int(m) for m in re.findall(r"^sim\d+:(\d+) +\| step \d+", out, re.M)}
        assert spoke == shown, out
        told = "17 nodes: the console shows rank 0 and every rank's stderr" in out
        assert told is (ranks is None), out
        nothing_left(sim)


def children_of(pid: int) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and parent(int(e)) == pid]


def test_a_tree_reaches_the_nodes_through_relays_and_leaves_nothing(tmp_path: Path) -> None:
    """With the tree on (bench/scale.py's large runs), the launcher holds a process for its
    inner node only: the other nodes' agents come through relays its fan-out started, which
    leave their sessions and are reaped by the fork server when the job ends. Every simulated
    node names its own interpreter, and they still share a fan-out (they got one each when
    the tree grouped the nodes by interpreter)."""
    nodes = 12
    sim = SimCluster(tmp_path / "sim", nodes=nodes, nproc=1).build(lines_per_second=2)
    process = launch(sim, "--seconds", "6", "--tree-above", "4", "--ranks", "all")
    try:
        assert len(sim.wait_events("run", nodes, timeout=90)) == nodes
        # Its children: the fork server (the launcher started it) and the inner node's agent.
        held = children_of(process.pid)
        out = process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, out
    assert len(held) == 2, held
    fanouts = [event for event in sim.events() if event[0] == "fanout"]
    assert 1 <= len(fanouts) <= 2, fanouts  # the starts gathered together, not one a node
    spoke = {int(m) for m in re.findall(r"^sim\d+:(\d+) +\| step \d+", out, re.M)}
    assert spoke == set(range(nodes)), out
    nothing_left(sim)


def test_a_forked_agent_answers_as_the_interpreter_would(tmp_path: Path) -> None:
    """The fork server (forkserver.py) stands in for the node's interpreter: the same output
    and exit code through the shim, and the shim's signals reach the process it forked."""
    sim = SimCluster(tmp_path / "sim", nodes=1, nproc=1).build()
    node_python = str(sim.python(0))
    by_interpreter = subprocess.run(
        [node_python, "-m", "torchherd.agent", "nonsense"], capture_output=True, text=True
    )
    server = sim.start_forkserver()
    try:
        forked = subprocess.run(
            [node_python, "-m", "torchherd.agent", "nonsense"], capture_output=True, text=True
        )
        assert (forked.returncode, forked.stderr) == (2, by_interpreter.stderr)
        probe = subprocess.run(
            [node_python, "-m", "torchherd.agent", "probe"],
            input="{}",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert probe.returncode == 0, probe.stderr
        facts = json.loads(probe.stdout)
        assert facts["python"] == sys.executable and facts["pid"] != server.pid
        # An agent waiting for its job: SIGTERM to the shim ends the agent as herd stop does.
        waiting = subprocess.Popen(
            [node_python, "-m", "torchherd.agent", "run"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        time.sleep(3)
        assert waiting.poll() is None
        forked_pids = [pid for pid in sim.processes() if pid not in (server.pid, waiting.pid)]
        assert forked_pids, "the agent was not forked"
        waiting.terminate()
        assert waiting.wait(timeout=30) != 0
    finally:
        server.terminate()
        server.wait(timeout=30)
    nothing_left(sim)
