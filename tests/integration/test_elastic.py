"""Recovery that costs little and gives back what it took, on the testbed with the Trainer.

A killed worker restarts in place (the same agents, a new attempt, resumed from the latest
snapshot, every step's loss that of a run never interrupted);
a node cut off and restored comes back into the job, which grows back to its size at its next
snapshot; with a hot spare, a lost node's place goes to the spare and the job ends with every
loss of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from tests.integration.live import LiveHerd, job_id
from tests.integration.procs import cmdline, environ, parent_of
from tests.integration.training import ARGS, losses, worker_on
from tests.slowdowns import cpu_ticks
from tests.testbed import Testbed

SCRIPTS = Path(__file__).parent / "scripts"


def trainer_job(
    testbed: Testbed,
    tmp_path: Path,
    nodes: list[dict[str, object]],
    options: list[str],
    script_args: list[str] = ARGS,
    env: dict[str, str] | None = None,
    **keys: object,
) -> tuple[LiveHerd, Path]:
    """`herd launch OPTIONS slow_minimal.py SCRIPT_ARGS` (the Trainer, a snapshot every 20
    steps by default; ``env``: more of the job's environment)."""
    home, run_dir = tmp_path / "home", tmp_path / "run"
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=nodes,
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home), **(env or {})},
        **keys,
    )
    herd = LiveHerd(
        ["-c", str(path), "--grace", "3", *options, "slow_minimal.py", *script_args]
        + ["--run-dir", str(run_dir)],
        home,
        testbed,
    )
    return herd, run_dir


def wait_for_snapshot(herd: LiveHerd, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 180
    while not (run_dir / "snapshots" / f"step-{step}").exists():
        assert time.monotonic() < deadline and herd.process.poll() is None, herd.output
        time.sleep(0.1)


def snapshot_steps(run_dir: Path) -> list[int]:
    found = [re.fullmatch(r"step-(\d+)", p.name) for p in (run_dir / "snapshots").iterdir()]
    return sorted(int(m.group(1)) for m in found if m)


def agents(home: Path, job: str, nodes: list[str]) -> dict[str, int]:
    return {
        n: json.loads((home / "nodes" / job / n / "agent.json").read_text())["pid"] for n in nodes
    }


def warmed_wrapper(testbed: Testbed, job: str, node: str, attempt: int) -> int:
    """The pid of the wrapper ``node``'s agent warms for ``attempt``, once it has imported
    torch (its CPU time stands still: it waits for its job on stdin)."""
    tags = {f"HERD_NODE={node}".encode(), f"HERD_ATTEMPT={attempt}".encode()}
    deadline = time.monotonic() + 120
    pid, last, still = None, -1, 0
    while time.monotonic() < deadline:
        if pid is None:
            pid = next(
                (
                    p
                    for p in testbed.processes_with_env("HERD_JOB_ID", job)
                    if tags <= environ(p) and b"--herd-prewarm" in (cmdline(p) or b"").split(b"\0")
                ),
                None,
            )
        try:
            used = cpu_ticks(pid) if pid is not None else -1
        except OSError:
            pid, used = None, -1  # gone: look for its successor
        still = still + 1 if pid is not None and used == last else 0
        if still == 2:  # for two seconds in a row
            return pid
        last = used
        time.sleep(1.0)
    raise AssertionError(f"{node}: no wrapper warmed for attempt {attempt} (last seen: {pid})")


def one_each(*hosts: str, spare: str | None = None) -> list[dict[str, object]]:
    nodes: list[dict[str, object]] = [{"host": h, "nproc": 1} for h in hosts]
    if spare:
        nodes.append({"host": spare, "nproc": 1, "spare": True})
    return nodes


def test_a_killed_worker_restarts_in_place_and_resumes(
    testbed: Testbed, tmp_path: Path, uninterrupted_losses: list[tuple[int, float]]
) -> None:
    # Attempt 0 at 0.1 s a step: a loaded machine may take seconds to import torch.
    herd, run_dir = trainer_job(
        testbed,
        tmp_path,
        one_each("node1", "node2"),
        ["--max-restarts", "1"],
        env={"SLOW_FIRST_ATTEMPT_S": "0.1"},
    )
    wait_for_snapshot(herd, run_dir, 40)
    job = job_id(herd.home)
    before = agents(herd.home, job, ["node1", "node2"])
    victim = worker_on(job, "node2", testbed)
    assert victim is not None
    # While attempt 0 trains, each node's agent warms attempt 1's wrapper (restarts are left).
    warmed = {node: warmed_wrapper(testbed, job, node, 1) for node in ("node1", "node2")}
    before_kill = max(snapshot_steps(run_dir))
    os.kill(victim, signal.SIGKILL)
    herd.wait_for(r"attempt 1 in place on the same 2 node\(s\)", 60)
    resumed = herd.wait_for(r"resumed from \S*/snapshots/step-(\d+)", 180)[0]
    assert agents(herd.home, job, ["node1", "node2"]) == before  # the same agents, in place
    # Attempt 1 runs in the wrappers warmed during attempt 0: their ranks are its children.
    for node, wrapper in warmed.items():
        rank = worker_on(job, node, testbed)
        assert rank is not None and parent_of(rank) == wrapper, (node, rank, wrapper)
    code = herd.finish(timeout=300)
    out = herd.output
    assert code == 0, out
    # From the last snapshot before the kill (or a later one), not an older one nor step 0.
    assert int(resumed.group(1)) >= before_kill >= 40, (out, before_kill)
    assert len(re.findall(r"resumed from", out)) == 1, out
    # Each step recorded once (the steps redone after the resume replace the lost ones), and
    # every loss is the uninterrupted run's.
    assert losses(run_dir) == uninterrupted_losses
    attempts = herd.record()["attempts"]
    assert [(a["n"], a["how"], a["outcome"]) for a in attempts] == [
        (0, "first", "failed"),
        (1, "in place", "succeeded"),
    ], attempts
    assert "killed by SIGKILL" in attempts[1]["why"], attempts
    # The restart handed its request to a wrapper with torch imported: no import after the
    # stop (1-2 s on a quiet machine) in the phase that times the wrapper.
    warm = {n["host"]: n["phases"]["wrapper warm"] for n in attempts[1]["nodes"]}
    assert all(seconds < 1.0 for seconds in warm.values()), warm
    herd.assert_clean(["node1", "node2"])


def test_a_node_that_comes_back_grows_the_job_back(clean_faults: Testbed, tmp_path: Path) -> None:
    """node3 cut off: the job goes on with 2 nodes; node3 restored: herd sweeps and checks
    it, asks the workers to save and stop, and the next attempt runs on 3 again."""
    testbed = clean_faults
    herd, run_dir = trainer_job(
        testbed,
        tmp_path,
        one_each("node1", "node2", "node3"),
        ["--max-restarts", "1", "--min-nodes", "2"],
        ["--max-steps", "1500", "--snapshot-every", "20", "--batch-size", "16"],
        launcher_silence=10,
    )
    wait_for_snapshot(herd, run_dir, 40)
    testbed.partition("node3")
    herd.wait_for(r"going on without node3", 60)
    herd.wait_for(r"resumed from", 120)
    testbed.heal("node3")
    herd.wait_for(r"node3 answers again", 120)
    herd.wait_for(r"node3 back: growing the job: asking every worker to save", 60)
    herd.wait_for(r"world size 3 \(was 2\)", 120)
    code = herd.finish(timeout=600)
    out = herd.output
    assert code == 0, out
    assert "world size changed from 2 to 3" in out, out  # the Trainer's own word
    record = herd.record()
    shape = [(a["world_size"], a["how"], a["outcome"]) for a in record["attempts"]]
    assert shape == [
        (3, "first", "lost"),
        (2, "new plan", "saved"),
        (3, "grown", "succeeded"),
    ], shape
    assert record["world_size"] == 3 and "node3 back in the job" in record["attempts"][2]["why"]
    steps = [step for step, _ in losses(run_dir)]
    assert steps[-1] == 1500 and len(steps) == len(set(steps)), steps[-5:]
    # node3's first agent, cut off, ends when its sshd finds that session gone (TCP's next
    # retransmission after the heal, backed off over the partition): as in the spare test.
    herd.assert_clean(["node1", "node2", "node3"], settle=90)


def test_a_spare_takes_a_lost_nodes_place_and_the_loss_is_unchanged(
    clean_faults: Testbed, tmp_path: Path, uninterrupted_losses: list[tuple[int, float]]
) -> None:
    testbed = clean_faults
    herd, run_dir = trainer_job(
        testbed,
        tmp_path / "spare",
        one_each("node1", "node2", spare="node3"),
        ["--max-restarts", "1"],
        launcher_silence=10,
    )
    assert "on 2 node(s) [node1×1, node2×1]" in herd.wait_for(r"herd \S+: job", 60)[0].string
    wait_for_snapshot(herd, run_dir, 40)
    testbed.partition("node2")
    herd.wait_for(r"spare node3 takes node2's place", 60)
    code = herd.finish(timeout=300)
    out = herd.output
    assert code == 0, out
    assert re.search(r"world size 2 as before", out), out
    assert losses(run_dir) == uninterrupted_losses  # every step's loss, as if nothing happened
    record = herd.record()
    assert [n["host"] for n in record["nodes"]] == ["node1", "node3"], record["nodes"]
    assert [a["how"] for a in record["attempts"]] == ["first", "spare"], record["attempts"]
    testbed.heal("node2")
    # node2's agent lingers for a launcher that may come back (LINGER); it ends when its sshd
    # finds the launcher's session gone, at TCP's next retransmission after the heal, which
    # backs off over a long partition (tens of seconds after a minute cut off, under load).
    herd.assert_clean(["node1", "node2", "node3"], settle=90)


def steps_job(
    testbed: Testbed, tmp_path: Path, nodes: list[dict[str, object]], args: list[str]
) -> LiveHerd:
    """`herd launch ARGS steps.py ...` (a plain loop of all-reduces, no snapshots)."""
    home = tmp_path / "home"
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=nodes,
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
        launcher_silence=10,
    )
    return LiveHerd(["-c", str(path), "--grace", "3", *args], home, testbed)


def test_a_node_that_fails_twice_in_a_row_is_set_aside(testbed: Testbed, tmp_path: Path) -> None:
    """node2's rank fails at step 5 of every attempt: after its second failure in a row the
    job goes on without it (--min-nodes 2) instead of crash-looping on it."""
    herd = steps_job(
        testbed,
        tmp_path,
        one_each("node1", "node2", "node3"),
        ["--max-restarts", "3", "--min-nodes", "2", "steps.py", "--steps", "40"]
        + ["--fail-host", "node2"],
    )
    code = herd.finish(timeout=300)
    out = herd.output
    assert code == 0, out
    assert "node2 failed 2 attempts in a row: set aside" in out, out
    assert "going on without node2: 2 node(s), rendezvous on node1" in out, out
    record = herd.record()
    assert [a["outcome"] for a in record["attempts"]] == ["failed", "failed", "succeeded"]
    assert [n["host"] for n in record["nodes"]] == ["node1", "node3"], record["nodes"]
    herd.assert_clean(["node1", "node2", "node3"])


def test_a_dead_spare_is_never_chosen(clean_faults: Testbed, tmp_path: Path) -> None:
    """The spare is cut off first: herd notices its silence (an idle agent answers pings) and
    drops it, so when node2 is lost the job goes on with node1 (--min-nodes 1) instead of
    waiting for a spare that will never join. 600 steps (30 s): the first attempt outlasts the
    spare's silence, so node2 is cut off while the job still runs."""
    testbed = clean_faults
    herd = steps_job(
        testbed,
        tmp_path,
        one_each("node1", "node2", spare="node3"),
        ["--max-restarts", "1", "--min-nodes", "1", "steps.py", "--steps", "600", "--quiet"],
    )
    herd.wait_for(r"STEPPING rank=1", 120)
    testbed.partition("node3")
    herd.wait_for(r"spare node3 stopped answering; it is no longer kept ready", 60)
    testbed.partition("node2")
    herd.wait_for(r"going on without node2: 1 node\(s\), rendezvous on node1", 60)
    code = herd.finish(timeout=240)
    out = herd.output
    assert code == 0, out
    assert "spare node3 takes" not in out, out
    assert [n["host"] for n in herd.record()["nodes"]] == ["node1"]
    testbed.heal("node2")
    testbed.heal("node3")
    # A cut-off node's sshd learns that herd's connection is gone only when it retransmits
    # into the healed link, and TCP's retransmission backoff grows with the cut's length (up
    # to about as long again): its agent, lingering for the launcher, ends then.
    herd.assert_clean(["node1", "node2", "node3"], settle=90)
