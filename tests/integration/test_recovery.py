"""Recovery on the testbed: real faults injected into a running job, and what herd does.

A frozen rank (SIGSTOP) before and after the first step, a node cut off (its link down), a
silent drop of its traffic (iptables DROP), a SIGKILLed agent with idle workers, the loss of
the rendezvous host with --min-nodes, and a crash loop that progress resets. Each test asserts
what herd itself reports (which node, which rank, which limit, what it swept), the evidence it
kept, the job record, and, under the process watch, that nothing herd started is left.
Seconds belong in bench/recovery.py, not here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.herd_cli import SCRIPTS
from tests.integration.herd_cli import one_worker_cluster as cluster
from tests.integration.live import LiveHerd, job_id, pids, resume, stacks_of
from tests.testbed import Testbed
from torchherd.recovery.hang import CONFIRM


def environ_of(pid: int) -> bytes:
    """A process's environment block; empty once it has exited (it may, between the scan that
    found it and this read)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def test_frozen_rank_is_named_with_its_stacks(testbed: Testbed, tmp_path: Path) -> None:
    """Default settings: silence makes herd look, the stopped rank is the evidence."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(["-c", str(path), "--grace", "3", "steps.py", "--quiet"], home, testbed)
    stepping = herd.wait_for(r"STEPPING rank=(?P<rank>\d) pid=(?P<pid>\d+)", 120, count=2)
    victim = next(m for m in stepping if m.group("rank") == "1")
    os.kill(pids(victim), signal.SIGSTOP)
    try:
        herd.wait_for(r"the job is hung", 120)
        code = herd.finish()
    finally:
        resume(pids(victim))
    out = herd.output
    assert code == 1, out
    found = re.search(r"the job is hung: node2 rank 1 stopped \(state T[^)]*\) for (\d+) s", out)
    assert found and int(found.group(1)) >= CONFIRM, out
    assert re.search(r"node2 rank 1: stopped \(state T", out), out
    assert "first failure: node2 rank 1" in out, out
    job = job_id(home)
    stacks = stacks_of(home, job)
    assert "node2-rank-1.txt" in stacks and "state T" in stacks["node2-rank-1.txt"], stacks
    assert "all_reduce" in stacks.get("node1-rank-0.txt", ""), stacks
    summary = json.loads(next((home / "jobs" / job / "stacks").rglob("summary.json")).read_text())
    assert summary["behind"][0]["rank"] == 1
    attempt = herd.record()["attempts"][-1]
    assert attempt["outcome"] == "hung" and attempt["noticed"] == "the hang watch", attempt
    assert attempt["behind"][0].startswith("node2 rank 1: stopped"), attempt
    shown = subprocess.run(
        [sys.executable, "-m", "torchherd", "logs", job, "--stacks"],
        env=dict(os.environ, HERD_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0 and "state T" in shown.stdout, shown.stdout + shown.stderr
    herd.assert_clean(["node1", "node2"])


def test_a_rank_frozen_before_its_first_step_is_named(testbed: Testbed, tmp_path: Path) -> None:
    """Frozen before init_process_group: the other rank waits in the process group's set-up,
    nothing was ever printed after start-up, and default settings still find it."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(
        ["-c", str(path), "--grace", "3", "phases.py", "--pause-before-init", "3"], home, testbed
    )
    started = herd.wait_for(r"STARTED rank=1 pid=(?P<pid>\d+)", 120)[0]
    os.kill(pids(started), signal.SIGSTOP)
    try:
        herd.wait_for(r"the job is hung", 120)
        code = herd.finish()
    finally:
        resume(pids(started))
    out = herd.output
    assert code == 1, out
    assert "STEPPING" not in out, out  # it never took a step
    assert re.search(r"the job is hung: node2 rank 1 stopped \(state T", out), out
    assert re.search(r"node2 rank 1: stopped \(state T[^)]*\) at <module> \(phases\.py:", out), out
    stacks = stacks_of(home, job_id(home))
    # The waiting rank is seen where it waits: setting up the process group.
    assert "init_process_group" in stacks.get("node1-rank-0.txt", ""), stacks
    herd.assert_clean(["node1", "node2"])


def test_node_cut_off_is_noticed_by_the_launcher_and_its_agent(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    """Without --min-nodes the job needs node3: the restart sweeps it (ssh waits
    connect_timeout for it), and gives up saying what to do."""
    testbed = clean_faults
    # The agents wait 15 s (not the default 90) for a launcher they no longer hear.
    path, home = cluster(
        testbed, tmp_path, ["node2", "node3"], launcher_silence=15, connect_timeout=3
    )
    herd = LiveHerd(
        ["-c", str(path), "--grace", "3", "--max-restarts", "1", "steps.py"], home, testbed
    )
    herd.wait_for(r"STEPPING rank=1", 120)
    job = job_id(home)
    testbed.partition("node3")
    herd.wait_for(r"node3 stopped answering at \d\d:\d\d:\d\d \(network or machine down\)", 60)
    # The attempt ends (grace + 25 s at most), the sweep waits (connect_timeout + grace + 15 s
    # at most), then herd gives up: 30 s of margin for a loaded machine.
    gave_up = r"herd: cannot restart: node3 still do\(es\) not answer: 1 node\(s\) left, 2 needed"
    herd.wait_for(gave_up, 3 + 25 + 3 + 3 + 15 + 30)
    code = herd.finish()
    out = herd.output
    assert code == 1, out
    assert "--min-nodes M" in out and "herd: attempt 1" not in out, out
    assert "first failure: node3: node3 stopped answering" in out, out
    assert "herd doctor" in out  # the remedy fits a lost node, not an ssh failure
    assert "ssh -v" not in out
    assert [a["outcome"] for a in herd.record()["attempts"]] == ["lost"]
    # Before node2's workers were stopped, their stacks were taken: its rank waits for node3's
    # in the all-reduce (the cut-off node itself cannot be reached for stacks).
    assert "herd: taking the workers' stacks as the other nodes stop" in out, out
    stacks_dir = home / "jobs" / job / "stacks" / "attempt-0"
    summary = json.loads((stacks_dir / "summary.json").read_text())
    assert summary["reasons"] == {"node2": "taken as the job stops"}, summary
    assert "all_reduce" in stacks_of(home, job).get("node2-rank-0.txt", ""), summary
    # The cut-off node's own agent ends its share of the job (it hears no launcher).
    on_node3: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        on_node3 = [
            pid
            for pid in testbed.processes_with_env("HERD_JOB_ID", job)
            if b"HERD_NODE=node3" in environ_of(pid)
        ]
        if not on_node3:
            break
        time.sleep(0.5)
    assert not on_node3, f"the agent on node3 left {on_node3} running"
    testbed.heal("node3")
    herd.assert_clean(["node2", "node3"], settle=30)


def test_silent_drop_of_a_nodes_traffic_is_a_lost_node(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    testbed = clean_faults
    path, home = cluster(testbed, tmp_path, ["node1", "node2"], launcher_silence=15)
    herd = LiveHerd(["-c", str(path), "--grace", "3", "steps.py"], home, testbed)
    herd.wait_for(r"STEPPING rank=1", 120)
    testbed.block_port("node2", 22)  # the launcher's ssh link to node2: packets vanish
    herd.wait_for(r"node2 stopped answering", 60)
    code = herd.finish()
    assert code == 1, herd.output
    testbed.unblock_port("node2", 22)
    herd.assert_clean(["node1", "node2"], settle=40)


def test_killed_agents_idle_workers_are_swept(testbed: Testbed, tmp_path: Path) -> None:
    """Workers that wait in no collective would never die by themselves: only the sweep of
    the lost agent's attempt (by job id and attempt) ends them."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2", "node3"])
    herd = LiveHerd(["-c", str(path), "--grace", "3", "phases.py", "--idle"], home, testbed)
    stepping = herd.wait_for(r"STEPPING rank=(?P<rank>\d) pid=(?P<pid>\d+)", 120, count=3)
    job = job_id(home)
    idle_worker = pids(next(m for m in stepping if m.group("rank") == "1"))
    agent = json.loads((home / "nodes" / job / "node2" / "agent.json").read_text())["pid"]
    os.kill(agent, signal.SIGKILL)
    herd.wait_for(r"node2 failed; stopping the other nodes", 60)
    code = herd.finish()
    out = herd.output
    assert code == 1, out
    assert "first failure: node2" in out and "lost contact with node2" in out, out
    assert re.search(r"ended \d+ process\(es\) of the attempt left on node2", out), out
    assert not Path(f"/proc/{idle_worker}").exists(), "node2's idle worker was not swept"
    herd.assert_clean(["node1", "node2", "node3"])


def test_a_dead_rank_stops_the_other_nodes_before_its_torchrun_has_ended(
    testbed: Testbed, tmp_path: Path
) -> None:
    """Rank 0 dies while its sibling on node1 takes 6 s to answer torchrun's SIGTERM: node1's
    torchrun ends only after it, but herd hears of the death from node1's wrapper at once and
    stops node2 then (its ranks wait in a collective that can never complete), not 6 s later;
    the failure is still reported from torchrun's own record: node1, rank 0, exit code 3."""
    home = tmp_path / "home"
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[{"host": "node1", "nproc": 2}, {"host": "node2", "nproc": 1}],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
    )
    run = ["stuck_sibling.py", "--run-dir", str(tmp_path)]
    herd = LiveHerd(["-c", str(path), "--grace", "10", *run], home, testbed)
    herd.wait_for(r"SIBLING leaving", 120)
    code = herd.finish()
    assert code == 1, herd.output
    lines = [line for _, line in herd.lines]

    def first(pattern: str) -> int:
        return next(i for i, line in enumerate(lines) if re.search(pattern, line))

    told, node2_stopped = first(r"node1 failed; stopping"), first(r"node2 .*stopped by SIGTERM")
    assert told < first(r"SIBLING leaving") and node2_stopped < first(r"SIBLING leaving"), (
        herd.output
    )
    failure = herd.record()["first_failure"]
    assert (failure["host"], failure["rank"], failure["exitcode"]) == ("node1", 0, 3), failure
    herd.assert_clean(["node1", "node2"])


def test_rendezvous_host_lost_job_goes_on_with_fewer_nodes(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    testbed = clean_faults
    path, home = cluster(testbed, tmp_path, ["node1", "node2", "node3"], launcher_silence=15)
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
        testbed,
    )
    deadline = time.monotonic() + 150
    while not (run_dir / "snapshots" / "step-40").exists():
        assert time.monotonic() < deadline and herd.process.poll() is None, herd.output
        time.sleep(0.1)
    testbed.partition("node1")
    herd.wait_for(r"node1 stopped answering", 60)
    herd.wait_for(r"going on without node1: 2 node\(s\), rendezvous on node2", 60)
    resumed = herd.wait_for(r"resumed from .*step-(\d+)", 120)[0]
    code = herd.finish(timeout=240)
    out = herd.output
    assert code == 0, out
    assert int(resumed.group(1)) >= 40, out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r and "step" in r]
    assert steps[-1] == 150 and len(steps) == len(set(steps)), steps
    assert "world size 2 (was 3)" in out, out
    record = herd.record()
    assert record["world_size"] == 2 and [n["host"] for n in record["nodes"]] == [
        "node2",
        "node3",
    ], record
    first, second = record["attempts"]
    assert (first["world_size"], first["outcome"]) == (3, "lost"), first
    assert (second["world_size"], second["how"], second["outcome"]) == (
        2,
        "new plan",
        "succeeded",
    ), second
    testbed.heal("node1")
    herd.assert_clean(["node1", "node2", "node3"], settle=30)


def test_crash_loop_counts_only_restarts_without_progress(testbed: Testbed, tmp_path: Path) -> None:
    """Rank 1 fails at step 10, 20, 30, 30, 30 of attempts 0 to 4: the first two restarts
    make progress (the counter starts again), the last two do not, and --crash-loop 2 stops
    the job there with its own exit code."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(
        [
            "-c",
            str(path),
            "--max-restarts",
            "10",
            "--crash-loop",
            "2",
            "phases.py",
            "--fail-rank",
            "1",
            "--progressive",
        ],
        home,
        testbed,
    )
    code = herd.finish(timeout=400)
    out = herd.output
    assert code == 4, out
    assert re.search(r"gave up: crash loop: 2 restart\(s\) in a row failed", out), out
    assert "after 4 restart(s)" in out, out
    assert "restart 5 of 10" not in out
    outcomes = [a["outcome"] for a in herd.record()["attempts"]]
    assert outcomes == ["failed"] * 5, outcomes
    herd.assert_clean(["node1", "node2"])
