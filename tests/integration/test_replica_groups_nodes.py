"""Replica groups of two nodes each (herd launch --replica-groups --group-nodes 2) on the
testbed: node1+node2 and node3+node4 are two groups of one torchrun each; node4's worker is
SIGKILLed mid-run. Nothing here is timed (the survivors' 6 s bound is test_replica_groups.py's,
which runs alone), so it runs beside other tests.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.integration.herd_cli import one_worker_cluster
from tests.integration.live import LiveHerd
from tests.integration.test_replica_groups import NODES, SPARE, read_record, wait_pid
from tests.testbed import Testbed

pytest.importorskip("torchft", reason="replica groups need torchft (pip install -e '.[dev]')")

# Enough steps that group 0 still trains when group 1 is back (a torchrun of two nodes to
# restart, torch imported on both, on a machine running three testbeds): a group that comes
# back after the others finished has nobody to heal from.
TWO_NODE_STEPS = 500


def test_groups_of_two_nodes_lose_a_worker_and_train_through(
    testbed: Testbed, tmp_path: Path
) -> None:
    """--group-nodes 2: node1+node2 and node3+node4 are two groups of one torchrun each.
    node4's worker killed: group 1 restarts as a whole and heals, group 0 goes on; every
    rank of both groups ends with the same weights."""
    path, home = one_worker_cluster(testbed, tmp_path, [*NODES, SPARE])
    run_dir = tmp_path / "run"
    args = ["-c", str(path), "--replica-groups", "--group-nodes", "2", "--max-restarts", "1"]
    script = ["groups_minimal.py", "--max-steps", str(TWO_NODE_STEPS), "--batch-size", "16"]
    herd = LiveHerd([*args, "--grace", "3", *script, "--run-dir", str(run_dir)], home)
    try:
        started = r"job (?P<job>\S+): 2 replica group\(s\) \[node1,node2, node3,node4\]"
        job = herd.wait_for(started, 60)[0].group("job")
        herd.wait_for(r"node3:0\b.*step [2-9]0/", 180)
        os.kill(wait_pid(f"{job}-g1", SPARE, testbed, 10), signal.SIGKILL)
        herd.wait_for(r"group 1 on node3,node4 rejoined and healed", 180)
        code = herd.finish(timeout=300)
    finally:
        if herd.process.poll() is None:
            herd.signal(signal.SIGTERM)
            herd.finish(timeout=60)
    out = herd.output
    assert code == 0, out[-6000:]
    record = read_record(home, job)
    assert [g["nodes"] for g in record["groups"]] == [["node1", "node2"], ["node3", "node4"]]
    assert not record["groups"][0]["outages"], record["groups"][0]
    # Group 0 went on: herd saw it commit steps past the one group 1 went down at (the 6 s
    # bound is test_replica_groups.py's, which runs alone).
    (outage,) = record["groups"][1]["outages"]
    assert outage["next_commit_s"] is not None, outage
    assert read_record(home, f"{job}-g0")["restarts"] == 0
    # Group 1 restarted as a whole: both of its nodes ran its second attempt.
    own = read_record(home, f"{job}-g1")
    assert own["restarts"] == 1 and len(own["attempts"]) == 2, own["attempts"]
    restarted = own["attempts"][-1]
    assert sorted(n["host"] for n in restarted["nodes"]) == ["node3", "node4"], restarted
    ranks = ["0", "0-1", "1", "1-1"]  # group 0's ranks 0 and 1, group 1's
    weights = [json.loads((run_dir / f"weights-{r}.json").read_text()) for r in ranks]
    assert [w["step"] for w in weights] == [TWO_NODE_STEPS] * 4
    assert all(w["weights"] == weights[0]["weights"] for w in weights[1:])
