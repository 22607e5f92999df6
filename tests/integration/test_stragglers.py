"""The slow node at 1.2x, named while the job runs, with its cause, on two testbed nodes.

A Trainer job, first balanced (nobody is named), then node2's data loader taking 1.2x a step
per batch: named within two minutes, its loader the cause and no other; with --swap-slow,
still slow SWAP_AFTER seconds later, node2 is swapped out: the workers save, and the job goes
on from that snapshot with the hot spare node3 in its place. Then a hand-written DDP loop (no
torchherd in it): a worker whose CPU a busy process on its node shares, then a worker held by
a real cgroup quota, each named in turn with its cause. (Every cause, a stopped worker's too,
at 1.1x, 1.2x, 1.5x and 3x, for both kinds of script, and the false names per node-hour are
bench/straggler.py's; the causes' evidence is judged in tests/unit/test_slow_causes.py.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.herd_cli import SCRIPTS
from tests.integration.live import LiveHerd, pids
from tests.slowdowns import Busy, Quota, SlowLoader, cpu_share, pin, quiet_machine, step_seconds
from tests.testbed import Testbed

# Runs alone (scripts/test): it judges a 1.2x slowdown; a test beside it would be the slowdown.
pytestmark = pytest.mark.serial

# Seconds of the balanced job watched: the watch's first judgement comes after its warm-up
# and window (about 15 s of beats) and half a minute of checks in a row.
BALANCED_FOR = 60.0
# The bound on naming a rank slowed 1.2x (the target), with no margin taken off it.
NAMED_WITHIN = 120.0
SLOWDOWN = 1.2
# The plain DDP loop's slowdowns, larger: its workers are not pinned, and with a busy process
# beside node1's worker on one core, the scheduler puts the testbed's own work (launcher,
# agents, sshd) on the other core, beside node2's worker: a CI run saw that make node2 1.22x
# slower than node1 crowded 1.2x. The 1.2x naming of a plain loop is bench/straggler.py's.
PLAIN_SLOWDOWN = 1.5
# --swap-slow: seconds a node named slow must stay the slowest before it is swapped out (long
# enough for the `herd top` look below to see the job as it was).
SWAP_AFTER = 10


def slow_line(herd: LiveHerd, count: int) -> str:
    found = herd.wait_for(r"herd: slow rank: (node\S+ rank \d+ .*)", NAMED_WITHIN, count=count)
    return found[count - 1].group(1)


def test_a_trainer_rank_waiting_for_its_data_loader_is_named_and_swapped_for_the_spare(
    testbed: Testbed, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[
            {"host": "node1", "nproc": 1},
            {"host": "node2", "nproc": 1},
            {"host": "node3", "nproc": 1, "spare": True},
        ],
        workdir=str(SCRIPTS),
        # One core per worker: on this two-core machine the balanced job is balanced.
        env={"HERD_HOME": str(home), "OMP_NUM_THREADS": "1"},
    )
    run_dir = str(tmp_path / "run")
    # 512 samples a step: about 150 ms of work against 30 ms of all-reduce.
    swap = ["--swap-slow", str(SWAP_AFTER)]
    script = ["heavy.py", "--run-dir", run_dir, "--batch-size", "512", "--snapshot-every", "100"]
    # The batches come through a data-loader worker per rank, which this file can slow.
    loader_control = tmp_path / "loader.json"
    script += ["--loader-control", str(loader_control)]
    # A balanced job needs a machine that nothing else keeps busy (a CI run was seen naming
    # node2 1.20x slower, cause unknown, right after other tests).
    quiet_machine()
    herd = LiveHerd(["-c", str(path), *swap, *script], home, testbed)
    loader: SlowLoader | None = None
    try:
        ranks = herd.wait_for(r"HEAVY rank=(?P<rank>\d) pid=(?P<pid>\d+)", 180, count=2)
        # Each rank on a core of its own, so that the two never take turns on one core while
        # the other has one to itself (herd would rightly name that one slower).
        for found in ranks:
            pin(int(found.group("pid")), int(found.group("rank")) % (os.cpu_count() or 1))
        time.sleep(BALANCED_FOR)
        assert "slow rank" not in herd.output, herd.output  # balanced: nobody named

        # node2's loader takes 1.2x the job's step a batch: its rank waits for its data.
        # Its first progress line may come late on a slow start (a CI run saw none in 60 s).
        herd.wait_for(r"\bsamples/s", 120)
        step_s = step_seconds(herd.output.splitlines(), 2 * 512)
        loader = SlowLoader(loader_control, 1, SLOWDOWN * step_s)
        held_at = time.time()
        line = slow_line(herd, 1)
        assert line.startswith("node2 rank 1 is "), line
        ratio = float(re.search(r"is (\d+\.\d+)x slower", line).group(1))  # type: ignore[union-attr]
        assert ratio >= 1.1, line
        assert "likely: its data loader: it waited " in line, line
        assert "throttled" not in line and "stopped" not in line, line
        assert "competing" not in line, line
        top = subprocess.run(
            [sys.executable, "-m", "torchherd", "top", "--once", "-c", str(path)],
            env=dict(os.environ, HERD_HOME=str(home)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "slow rank: node2 rank 1" in top.stdout, top.stdout + top.stderr
        # Each node's recent step times, from its agent (a sparkline and the newest).
        assert "STEP TIME" in top.stdout, top.stdout
        rows = [line for line in top.stdout.splitlines() if line.startswith(("node1", "node2"))]
        assert len(rows) == 2 and all(re.search(r" \d+ms\s*$", r) for r in rows), top.stdout
        # Still the slowest SWAP_AFTER s later: swapped out at a snapshot, the spare in.
        herd.wait_for(r"herd: node2 is still slow \d+ s after it was named: swapping it out", 60)
        loader.release()  # before the spare, which takes rank 1, starts
        loader = None
        resumed = herd.wait_for(r"node1:0 .*\bresumed from \S*step-(?P<step>\d+)", 120)[0]
        herd.signal(signal.SIGINT)
        code = herd.finish(timeout=120)
    finally:
        if loader is not None:
            loader.release()
        if herd.process.poll() is None:
            herd.process.kill()
    assert code == 130, herd.output
    record = herd.record()
    assert record["slow"].startswith("node2 rank 1"), record
    slowed, swapped = record["attempts"]
    assert slowed["slow"] == [record["slow"]]
    # The swap: the same world on node1 and the spare, from the snapshot the workers wrote
    # when asked (the last step they reached: nothing trained twice), node2 left out.
    assert swapped["how"] == "spare" and "swapping it out" in swapped["why"], swapped
    assert [n["host"] for n in swapped["nodes"]] == ["node1", "node3"], swapped["nodes"]
    assert swapped["world_size"] == slowed["world_size"] == 2
    saved = re.findall(r"node1:0 .*\bsnapshot \S*step-(\d+)", herd.output)
    assert saved and resumed.group("step") == saved[-1], (saved, resumed.group(0))
    assert int(resumed.group("step")) >= slowed["max_step"] - 1, (resumed.group(0), slowed)
    # Each node's step time over the run (the report page's strips): node2's work per step
    # (its wait for data included) is higher than node1's while slowed, and the strip is
    # marked where it was named.
    nodes = {n["host"]: n for n in slowed["nodes"]}
    assert nodes["node2"]["named_slow_at"] > held_at and "named_slow_at" not in nodes["node1"]

    def held(host: str) -> float:
        values = sorted(v for _, v, at in nodes[host]["step_times"] if at > held_at + 5)
        return values[len(values) // 2]

    assert nodes["node1"]["step_times_measure"] == "work"
    assert held("node2") > 1.05 * held("node1"), (held("node1"), held("node2"))
    herd.assert_clean(["node1", "node2", "node3"])


def test_a_plain_ddp_script_names_a_crowded_and_a_throttled_rank(
    testbed: Testbed, tmp_path: Path
) -> None:
    """herd's workers read DDP's own timing of each iteration: node1's worker, sharing its CPU
    with a busy process on its node that takes a third of it, is named with that process's
    pid; then node2's worker held by a cgroup quota to 1/1.5 of the CPU it used, with the
    quota. Each within two minutes of its slowdown, neither with the other's cause."""
    home = tmp_path / "home"
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[{"host": "node1", "nproc": 1}, {"host": "node2", "nproc": 1}],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home), "OMP_NUM_THREADS": "1"},
    )
    herd = LiveHerd(["-c", str(path), "heavy.py", "--plain"], home, testbed)
    harms: list[Busy | Quota] = []
    try:
        found = herd.wait_for(r"HEAVY rank=(?P<rank>\d) pid=(?P<pid>\d+)", 180, count=2)
        workers = {int(m.group("rank")): pids(m) for m in found}
        # Slowed from the first steps: the watch's warm-up leaves those out by itself.
        busy = Busy(testbed, "node1", workers[0], PLAIN_SLOWDOWN)
        harms.append(busy)
        line = slow_line(herd, 1)
        assert line.startswith("node1 rank 0 is "), line
        # The competing process by its name (python or python3, as this suite runs) and pid.
        competing = rf"competing for its CPU: python\S* \(pid {busy.process.pid}, "
        assert re.search(competing, line), line
        assert "stopped" not in line and "throttled by its cgroup" not in line, line
        harms.pop().release()

        harms.append(Quota(workers[1], cpu_share(workers[1]) / PLAIN_SLOWDOWN))
        line = slow_line(herd, 2)
        assert line.startswith("node2 rank 1 is "), line
        assert "likely: CPU throttled by its cgroup (quota " in line, line
        assert "stopped" not in line and "competing" not in line, line
        herd.signal(signal.SIGINT)
        code = herd.finish(timeout=120)
    finally:
        for harm in harms:
            harm.release()
        if herd.process.poll() is None:
            herd.process.kill()
    assert code == 130, herd.output
    assert len(herd.record()["attempts"][0]["slow"]) == 2
    herd.assert_clean(["node1", "node2"])
