"""Replica groups on the testbed (herd launch --replica-groups): three nodes, three torchft
groups, real faults, what herd reports.

One run serves every test of the module (a run costs about a minute of three trainers on two
cores): group 2's worker is SIGKILLed mid-run (the other two must commit their next step within
6 s, none of their processes restarting; group 2 is restarted alone and heals from them), then
the lighthouse is SIGKILLed (herd restarts it; training goes on) while node3's link is cut
(the spare node4 takes group 2's place and heals; the cut-off worker is ended once node3 is
back), then every group at once (each resumes from herd's last snapshot), and the run must
finish with every group's weights identical; the first kill lands while a survivor waits in
the all-reduce for group 2's share, and `herd top` is read while group 2 is out. The nodes
resolve their own names to 127.0.1.1, so this also shows that torchft is given routable
addresses. One more run: a slowed group named by the judge across the groups. (Groups of two
nodes: test_replica_groups_nodes.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.herd_cli import SCRIPTS, one_worker_cluster
from tests.integration.herd_cli import herd as herd_cli
from tests.integration.live import LiveHerd
from tests.integration.training import worker_on
from tests.testbed import Testbed
from torchherd.agent.stacks import py_spy, run_py_spy

# Runs alone (scripts/test): the survivors' next commit is bounded at 6 s.
pytestmark = pytest.mark.serial

pytest.importorskip("torchft", reason="replica groups need torchft (pip install -e '.[dev]')")

NODES = ["node1", "node2", "node3"]
SPARE = "node4"
STEPS = 800
# The bound on naming a slowed group (the slow-node watch's target for 1.2x; this one is 1.5x).
NAMED_WITHIN = 120.0
# What the issue asks of the survivors: their next committed step within 6 s of the loss
# (torchft's default heartbeat; herd's lighthouse drops a silent group after 3 s).
NEXT_COMMIT_WITHIN = 6.0
# Where a group's worker waits for the others' gradients: ReplicaGroups.commit's wait.
ALLREDUCE_WAIT = re.compile(r"\bcommit \(\S*torchherd/train/replica_groups\.py:\d+\)")
# What the Trainer says when it wrote a snapshot (the group that writes them, in the console).
SNAPSHOT = r"node\d:0\b.*\bsnapshot \S*step-(?P<step>\d+)"


@dataclass
class GroupsRun:
    herd: LiveHerd
    code: int
    job: str
    run_dir: Path
    home: Path
    killed_at: float
    survivor_stack: str
    """node1's worker's stack while group 2's worker was stopped, just before it was killed."""
    survivors_before: dict[str, int]
    lighthouse_pids: tuple[int, int | None]
    before_all_killed: dict
    """The job's record and each group's, as they stood before every group was killed."""
    last_snapshot: int
    """The step of the last snapshot written before every group was killed."""
    left_on_cut_node: int | None
    """A worker of group 2 still on node3 a minute after its link came back (None: none)."""
    top_while_down: str
    """`herd top --once` while group 2 was out after its worker was killed."""
    cut_next_commit: float
    """Seconds from node3's link cut to node1's second step line after it (an upper bound on
    the survivors' next commit: a line every 10 steps)."""

    def herd_record(self) -> dict:
        """The job's own record (its groups and lighthouse have records of their own)."""
        return read_record(self.home, self.job)


def step_lines(herd: LiveHerd) -> list[tuple[float, str, int]]:
    """(time read, node, step) of every "step N/M" line a group's rank 0 logged."""
    found = []
    for at, line in list(herd.lines):
        if said := re.search(r"^(node\d):0\b.*\bstep (\d+)/", line):
            found.append((at, said.group(1), int(said.group(2))))
    return found


def steps_past(herd: LiveHerd, node: str, step: int, count: int, timeout: float) -> list[float]:
    """When the first ``count`` step lines of ``node`` past ``step`` were read."""
    deadline = time.monotonic() + timeout
    while len(past := [t for t, n, s in step_lines(herd) if n == node and s > step]) < count:
        assert time.monotonic() < deadline, f"{node} logged no step past {step}:\n{herd.output}"
        time.sleep(0.2)
    return past


def read_record(home: Path, job: str) -> dict:
    return json.loads((home / "jobs" / job / "job.json").read_text())


def wait_gone(job: str, node: str, testbed: Testbed, timeout: float) -> int | None:
    """None once no worker of ``job`` runs on ``node``; its pid if one still does."""
    deadline = time.monotonic() + timeout
    while (pid := worker_on(job, node, testbed)) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    return pid


def wait_pid(job: str, node: str, testbed: Testbed, timeout: float, other_than: int = 0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = worker_on(job, node, testbed)
        if pid is not None and pid != other_than:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"no worker of {job} on {node} within {timeout} s")


def stack_in_allreduce(pid: int, within: float) -> str:
    """The worker's stack once it waits in the Trainer's all-reduce over the groups (its
    last stack if it did not within ``within`` seconds: the test then fails on it)."""
    deadline = time.monotonic() + within
    stack = ""
    while time.monotonic() < deadline:
        stack, _ = run_py_spy(py_spy(), pid, [], timeout=5)
        stack = stack or ""
        if ALLREDUCE_WAIT.search(stack):
            break
        time.sleep(0.1)
    return stack


@pytest.fixture(scope="module")
def groups_run(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> GroupsRun:
    tmp_path = tmp_path_factory.mktemp("groups")
    home = tmp_path / "home"
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[
            *({"host": h, "nproc": 1} for h in NODES),
            {"host": SPARE, "nproc": 1, "spare": True},
        ],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
    )
    run_dir = tmp_path / "run"
    args = ["-c", str(path), "--replica-groups", "--max-restarts", "2", "--grace", "3"]
    script = ["groups_minimal.py", "--max-steps", str(STEPS), "--snapshot-every", "50"]
    herd = LiveHerd([*args, *script, "--batch-size", "16", "--run-dir", str(run_dir)], home)
    try:
        job = herd.wait_for(r"job (?P<job>\S+): 3 replica group\(s\)", 60)[0].group("job")
        herd.wait_for(r"node3:0\b.*step [2-9]0/", 180)
        survivors = {
            node: wait_pid(f"{job}-g{i}", node, testbed, 10) for i, node in enumerate(NODES[:2])
        }
        victim = wait_pid(f"{job}-g2", "node3", testbed, 10)
        # Killed while the others are inside the gradients' all-reduce: stopped first, so
        # that the survivors block in it waiting for its share (seen in a survivor's stack),
        # then killed (torchft 0.2.0's own DDP crashes every survivor here).
        os.kill(victim, signal.SIGSTOP)
        survivor_stack = stack_in_allreduce(survivors["node1"], within=2.0)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        # What `herd top` shows of the groups while group 2 is out.
        herd.wait_for(r"replica group 2 on node3 went down", 30)
        top = herd_cli(["top", "--once", "-c", str(path)], home, tmp_path)
        herd.wait_for(r"group 2 on node3 rejoined and healed", 180)
        old = wait_pid(f"{job}-lighthouse", "node1", testbed, 10)
        # Two faults at once: node3's link cut (group 2 is lost with it; the spare takes its
        # place and heals) and, while it is cut, the lighthouse killed (herd restarts it).
        # First the cut alone: the survivors wait for the quorum (or their all-reduce with
        # node3 times out) and go on. Their next commit is bounded on the test's clock by
        # node1's second step line after the cut (the first may have been on its way).
        before = max(step for _, node, step in step_lines(herd) if node == "node1")
        cut_at = time.monotonic()
        testbed.partition("node3")
        try:
            past = steps_past(herd, "node1", before, count=2, timeout=60)
            cut_next_commit = past[1] - cut_at
            os.kill(old, signal.SIGKILL)
            new = wait_pid(f"{job}-lighthouse", "node1", testbed, 90, other_than=old)
            herd.wait_for(rf"group 2: node3 does not answer; spare {SPARE} takes its place", 90)
        finally:
            testbed.heal("node3")
        herd.wait_for(rf"group 2 on {SPARE} rejoined and healed", 120)
        left_on_cut_node = wait_gone(f"{job}-g2", "node3", testbed, 60)
        # Then every group at once: no live group to heal from, so each resumes from the
        # last snapshot herd's Trainer wrote (never from step 1: torchft keeps nothing).
        written = len(re.findall(SNAPSHOT, herd.output))
        last = int(herd.wait_for(SNAPSHOT, 120, count=written + 1)[-1].group("step"))
        before = {"job": read_record(home, job)}
        before |= {f"g{i}": read_record(home, f"{job}-g{i}") for i in range(len(NODES))}
        placed = [*NODES[:2], SPARE]
        everyone = [wait_pid(f"{job}-g{i}", n, testbed, 10) for i, n in enumerate(placed)]
        for pid in everyone:
            os.kill(pid, signal.SIGKILL)
        code = herd.finish(timeout=300)
    finally:
        if herd.process.poll() is None:
            herd.signal(signal.SIGTERM)
            herd.finish(timeout=60)
    return GroupsRun(
        herd, code, job, run_dir, home, killed_at, survivor_stack, survivors, (old, new), before,
        last, left_on_cut_node, top.stdout + top.stderr, cut_next_commit,
    )  # fmt: skip


def test_survivors_commit_within_6_s_without_restarting(groups_run: GroupsRun) -> None:
    out = groups_run.herd.output
    assert groups_run.code == 0, out[-6000:]
    # Each survivor's own measure: from the step the loss made it drop to its next commit.
    for node in ("node1", "node2"):
        said = re.search(rf"{node}:0\b.*step \d+ committed (?P<s>[\d.]+) s after the dropped", out)
        assert said, out[-6000:]
        assert float(said.group("s")) <= NEXT_COMMIT_WITHIN, said.group(0)
    assert re.search(r"the other groups committed step \d+ [\d.]+ s after it went down", out)
    before = groups_run.before_all_killed
    outage = before["job"]["groups"][2]["outages"][0]  # the SIGKILL (then the cut link)
    assert outage["host"] == "node3" and outage["next_commit_s"] is not None, outage
    # The survivors ran once: no restart, no second worker (until every group was killed).
    for index in (0, 1):
        group = before["job"]["groups"][index]
        assert group["runs"] == 1 and not group["outages"], group
        own = before[f"g{index}"]
        assert own["restarts"] == 0 and len(own["attempts"]) == 1, own
    assert "restarting the job" not in "\n".join(
        line for line in out.splitlines() if "node1:0" in line or "node2:0" in line
    )


def test_a_group_killed_during_the_allreduce_leaves_the_survivors_running(
    groups_run: GroupsRun,
) -> None:
    # The kill landed while node1's worker waited in the all-reduce for group 2's share ...
    assert ALLREDUCE_WAIT.search(groups_run.survivor_stack), groups_run.survivor_stack
    # ... and the same worker went on: its step was dropped, not its process.
    out = groups_run.herd.output
    assert re.search(r"node1:0\b.*step \d+ dropped: a replica group was lost", out), out[-6000:]
    assert groups_run.before_all_killed["g0"]["restarts"] == 0


def test_herd_top_shows_each_group_and_the_one_that_is_down(groups_run: GroupsRun) -> None:
    top = groups_run.top_while_down
    line = next((x for x in top.splitlines() if "replica groups:" in x), "")
    assert line.startswith(f"job {groups_run.job}: replica groups:"), top
    said = re.search(
        r"g0 node1 step (\d+); g1 node2 step (\d+); g2 node3 down \d+ s \(since step (\d+)\)", line
    )
    assert said, line
    # Down since the step herd recorded for the outage.
    outage = groups_run.before_all_killed["job"]["groups"][2]["outages"][0]
    assert int(said.group(3)) == outage["steps_before"], (line, outage)


def test_killed_group_rejoins_heals_and_ends_with_identical_weights(groups_run: GroupsRun) -> None:
    out = groups_run.herd.output
    assert groups_run.code == 0, out[-6000:]
    outage = groups_run.herd_record()["groups"][2]["outages"][0]
    assert outage["healed_s"] is not None and outage["healed_s"] > outage["next_commit_s"], outage
    assert re.search(r"node3:0\b.*healed from a live replica group at step \d+", out), out[-6000:]
    weights = [json.loads((groups_run.run_dir / f"weights-{g}.json").read_text()) for g in range(3)]
    assert [w["step"] for w in weights] == [STEPS] * 3, [w["step"] for w in weights]
    assert weights[0]["weights"] == weights[1]["weights"] == weights[2]["weights"]
    # The report page tells the outage: group 2 out at the step the others had reached.
    made = herd_cli(["report", groups_run.job], groups_run.home, groups_run.run_dir.parent)
    assert made.returncode == 0, made.stderr
    page = Path(made.stdout.split("report: ", 1)[1].strip()).read_text()
    moved = f"<td>2</td><td>node3 → {SPARE}</td>"  # group 2 and the nodes it ran on
    row = moved + r"<td>\d+</td><td>0</td><td>down (?P<in>\d+) s in [^<]*</td>"
    said = re.search(row, page)
    assert said and f"at step {outage['steps_before']};" in said.group(0), page[-3000:]
    record = groups_run.herd_record()
    assert record["started"] < outage["down_at"] < record["ended"], (record["started"], outage)
    assert int(said.group("in")) == round(outage["down_at"] - record["started"])
    assert "healed" in said.group(0)
    # Group 2's three (killed, cut off, every group killed), one each for the others.
    assert page.count('class="outage"') == 5


def test_lighthouse_killed_is_restarted_and_training_goes_on(groups_run: GroupsRun) -> None:
    old, new = groups_run.lighthouse_pids
    assert new is not None and new != old
    out = groups_run.herd.output
    restarted = re.search(r"restarting the job \(restart 1 of 1000\)", out)
    assert restarted, out[-6000:]
    # Its quorum log (lines every step) stays in its files, off the console.
    assert "torchft::lighthouse" not in out
    log = groups_run.home / "jobs" / groups_run.job / "lighthouse" / "rank-0.log"
    assert "torchft::lighthouse" in log.read_text()
    # Every group reached the last step after the lighthouse came back (code 0, all weights).
    assert groups_run.code == 0
    for g in range(3):
        assert json.loads((groups_run.run_dir / f"weights-{g}.json").read_text())["step"] == STEPS


def test_every_group_killed_resumes_from_herds_last_snapshot(groups_run: GroupsRun) -> None:
    out = groups_run.herd.output
    assert groups_run.code == 0, out[-6000:]
    assert "every replica group is down" in out, out[-6000:]
    resumed_at = {}
    for node in [*NODES[:2], SPARE]:  # group 2 runs on the spare by then
        resumed = re.findall(rf"{node}:0\b.*\bresumed from \S*step-(\d+)", out)
        assert resumed and int(resumed[-1]) >= groups_run.last_snapshot, (node, resumed)
        resumed_at[node] = int(resumed[-1])
    # The groups restart each on its own: the first back resume from the snapshot of the
    # kill; one that comes back later (a loaded node's start) finds the run's newer snapshot,
    # written meanwhile by those that came back first.
    assert min(resumed_at.values()) == groups_run.last_snapshot, resumed_at
    weights = [json.loads((groups_run.run_dir / f"weights-{g}.json").read_text()) for g in range(3)]
    assert [w["step"] for w in weights] == [STEPS] * 3


def test_a_cut_off_groups_place_goes_to_the_spare(groups_run: GroupsRun) -> None:
    out = groups_run.herd.output
    assert groups_run.code == 0, out[-6000:]
    group = groups_run.herd_record()["groups"][2]
    assert group["hosts"] == ["node3", SPARE] and group["host"] == SPARE, group
    cut = group["outages"][1]
    assert cut["host"] == "node3" and cut["healed_s"] is not None, group["outages"]
    # The survivors went on within the bound though node3 did not die but went silent.
    assert groups_run.cut_next_commit <= NEXT_COMMIT_WITHIN, groups_run.cut_next_commit
    # The cut-off worker never rejoins beside its replacement: ended once its node is back.
    assert groups_run.left_on_cut_node is None


def stop_now_and_then(pid: int, stopped: float, every: float, done: threading.Event) -> None:
    """Hold a process stopped ``stopped`` s of every ``every`` s (a node that keeps losing its
    CPU) until ``done``."""
    while not done.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped)
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(every - stopped)


def test_a_slow_group_is_named_by_the_judge_across_the_groups(
    testbed: Testbed, tmp_path: Path
) -> None:
    """Groups of one node: no group's own watch has two ranks to compare, yet every group
    waits for the slowest in the all-reduce over the groups. node3's worker held stopped
    35 ms of every 100 is named, and kept in the job's record with its group. (A stop that
    lands in the script's 50 ms sleep a step costs nothing: herd read 1.15x.)"""
    path, home = one_worker_cluster(testbed, tmp_path, NODES)
    script = ["groups_minimal.py", "--max-steps", "5000", "--batch-size", "16"]
    args = ["-c", str(path), "--replica-groups", "--grace", "3", *script]
    herd = LiveHerd([*args, "--run-dir", str(tmp_path / "run")], home)
    done = threading.Event()
    try:
        job = herd.wait_for(r"job (?P<job>\S+): 3 replica group\(s\)", 60)[0].group("job")
        herd.wait_for(r"node3:0\b.*step [1-9]0/", 180)
        victim = wait_pid(f"{job}-g2", "node3", testbed, 10)
        threading.Thread(target=stop_now_and_then, args=(victim, 0.035, 0.1, done)).start()
        slowed_at = time.monotonic()
        named = herd.wait_for(r"herd: slow rank: (?P<host>node\d) rank (?P<rank>\d+) is ", 150)
        took = time.monotonic() - slowed_at
    finally:
        done.set()
        if herd.process.poll() is None:
            herd.signal(signal.SIGTERM)
            herd.finish(timeout=60)
    # Read once herd has ended: the record is written just after the line is said.
    record = read_record(home, job)
    assert (named[0].group("host"), named[0].group("rank")) == ("node3", "0"), named[0].group(0)
    assert took <= NAMED_WITHIN, took
    assert (record.get("slow") or "").startswith("group 2: node3 rank 0 is "), record.get("slow")
