"""The hang watch, round two, on the testbed: waits on the world outside the job that are not
hangs, and hangs that used to hide (inside a phase, after the others finished, behind a rank's own
DataLoader worker, on a node cut off with a full link).

Each test asserts what herd itself reports (which rank, which limit, and what it must never
say), and, under the process watch, that nothing herd started is left. Seconds belong in
bench/recovery.py, not here: the bounds below are ones a loaded machine cannot eat.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from tests.integration.herd_cli import SCRIPTS
from tests.integration.herd_cli import one_worker_cluster as cluster
from tests.integration.live import LiveHerd, job_id, stacks_of
from tests.testbed import Testbed
from torchherd.errors import EXIT_NEVER_EXITED

NODES = ["node1", "node2", "node3"]


def test_waits_on_the_world_outside_the_job_are_not_hangs(testbed: Testbed, tmp_path: Path) -> None:
    """Default settings, in silence: for 30 s rank 0 downloads from a server on its node's
    loopback that sends a byte a second while rank 2 is blocked on a file lock another process
    holds, and rank 1 waits in a barrier; then rank 1 sleeps 30 s (a backoff) while the others
    wait in an all-reduce; then rank 1 is in state D (a mount that hiccups) for 30 s while the
    others wait in a barrier. None of it is a hang. Each wait outlasts the earliest verdict the
    watch could give (10 s of silence, then 10 s to confirm) by a whole confirmation more."""
    path, home = cluster(testbed, tmp_path, NODES)
    waits = ["--download", "30", "--lock", "30", "--together", "--backoff", "30"]
    waits += ["--disk-wait", "30"]
    herd = LiveHerd(["-c", str(path), "waits.py", *waits], home, testbed)
    code = herd.finish(timeout=420)
    out = herd.output
    assert code == 0, out
    assert len(re.findall(r"DONE rank=\d", out)) == 3, out
    assert "WAITED disk" in out and "hung" not in out, out
    herd.assert_clean(NODES)


def test_a_deadlock_inside_a_phase_is_caught_by_the_hang_timeout(
    testbed: Testbed, tmp_path: Path
) -> None:
    """Rank 1 deadlocks inside phase("saving") while the others wait in a barrier, with
    --hang-timeout 30: a phase is no blank cheque. Named well within 120 s."""
    path, home = cluster(testbed, tmp_path, NODES)
    herd = LiveHerd(
        ["-c", str(path), "--hang-timeout", "30", "waits.py", "--deadlock-in-phase"],
        home,
        testbed,
    )
    herd.wait_for(r"STEPPING rank=1", 180)
    stuck = time.monotonic()
    herd.wait_for(r"the job is hung", 120)
    assert time.monotonic() - stuck <= 120
    code = herd.finish(timeout=120)
    out = herd.output
    assert code == 1, out
    assert "set by --hang-timeout" in out and "rank 1 in phase 'saving'" in out, out
    assert re.search(r"node2 rank 1: idle in phase 'saving'", out), out
    herd.assert_clean(NODES)


def test_a_rank_waiting_for_its_stuck_data_loader_worker_is_named(
    testbed: Testbed, tmp_path: Path
) -> None:
    """Rank 1's DataLoader worker blocks for ever on a lock while the rank waits for its batch
    (and wakes every 5 s to check that the worker lives) and the others wait in an
    all-reduce. The rank used to count as waiting outside the job (10 minutes) for its own
    polling; with default settings herd names the hang, the rank and its worker's place, and
    takes the worker's stacks too."""
    path, home = cluster(testbed, tmp_path, NODES)
    herd = LiveHerd(["-c", str(path), "waits.py", "--loader-stuck"], home, testbed)
    herd.wait_for(r"STEPPING rank=1", 180)
    stuck = time.monotonic()
    herd.wait_for(r"the job is hung", 120)
    assert time.monotonic() - stuck <= 120
    code = herd.finish(timeout=120)
    out = herd.output
    assert code == 1, out
    assert re.search(
        r"node2 rank 1 idle \(no CPU, no I/O, the same frames, in its data-loader worker too\) "
        r"while the others wait in all_reduce",
        out,
    ), out
    assert re.search(
        r"node2 rank 1: blocked at its data-loader worker \(pid \d+\) at \S*__getitem__ "
        r"\(waits\.py:\d+\)",
        out,
    ), out
    stacks = stacks_of(home, job_id(home))
    worker = [text for name, text in stacks.items() if name.startswith("node2-rank-1-child-")]
    assert any("__getitem__" in text for text in worker), (sorted(stacks), out)
    herd.assert_clean(NODES)


def test_a_rank_that_never_exits_after_the_others_finished_is_named(
    testbed: Testbed, tmp_path: Path
) -> None:
    """Ranks 0 and 2 finish; rank 1's interpreter waits for ever on a non-daemon thread.
    herd names it within 3 minutes, takes its stacks, says the job finished and ends it with
    the exit code that says so: the job's work is done, so nothing is restarted, even with
    restarts allowed. With --hang-timeout 20, whose plain limit bounds the wait after the
    others finished (by default a minute: tests/unit/test_hang.py), and which alone used to
    call the rank hung and restart the finished job."""
    path, home = cluster(testbed, tmp_path, NODES)
    args = ["-c", str(path), "--max-restarts", "1", "--hang-timeout", "20"]
    herd = LiveHerd([*args, "waits.py", "--never-exit"], home, testbed)
    herd.wait_for(r"DONE rank=1", 180)
    done = time.monotonic()
    herd.wait_for(r"finished, but node2 rank 1 never exited", 180)
    assert time.monotonic() - done <= 180
    code = herd.finish(timeout=120)
    out = herd.output
    assert code == EXIT_NEVER_EXITED, out
    assert "herd: the job finished, but node2 rank 1 never exited" in out, out
    assert "limit 20 s" in out, out
    assert "is hung" not in out and "restarting the job" not in out, out
    assert "attempt 1" not in out, out
    assert re.search(r"job \S+ finished in [\d.]+ s, but a rank never exited", out), out
    stacks = stacks_of(home, job_id(home))
    assert "threading" in stacks.get("node2-rank-1.txt", ""), (sorted(stacks), out)
    assert herd.record()["state"] == "finished, a rank never exited", out
    herd.assert_clean(NODES)


def test_a_torchrun_frozen_before_it_starts_its_workers_is_named(
    testbed: Testbed, tmp_path: Path
) -> None:
    """node3's torchrun is stopped (SIGSTOP) the moment it starts: its interpreter (node3's
    python in herd.toml) stops itself before it runs torchrun, so node3 never starts a worker
    and the other nodes wait for it in the rendezvous. herd names node3 and ends the job well
    before torch's own timeouts (10 minutes), and before the start-up limit (5 minutes)."""
    frozen = tmp_path / "frozen-python"
    frozen.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" torchherd.agent.elastic "*) kill -STOP $$ ;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    frozen.chmod(0o755)
    home = tmp_path / "home"
    nodes: list[str | dict[str, object]] = [{"host": h, "nproc": 1} for h in NODES]
    nodes[2] = {"host": "node3", "nproc": 1, "python": str(frozen)}
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml", nodes=nodes, workdir=str(SCRIPTS), env={"HERD_HOME": str(home)}
    )
    herd = LiveHerd(["-c", str(path), "waits.py"], home, testbed)
    herd.wait_for(r"world size 3", 180)
    launched = time.monotonic()
    herd.wait_for(r"the job is hung: node3: torchrun stopped \(state T", 150)
    assert time.monotonic() - launched <= 150
    code = herd.finish(timeout=120)
    out = herd.output
    assert code == 1, out
    assert re.search(r"first failure: node3: hung: node3: torchrun stopped", out), out
    assert "node3: torchrun (pid " in out and "STEPPING" not in out, out
    herd.assert_clean(NODES)


def test_a_node_cut_off_with_a_full_link_ends_its_workers(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    """node3's link is cut while its rank prints a lot: nothing reads what its agent writes
    (a partition closes nothing; the buffers fill). Its workers must still be gone within
    launcher_silence (15 s here) plus the grace period (3 s), while the link stays cut."""
    testbed = clean_faults
    path, home = cluster(testbed, tmp_path, ["node2", "node3"], launcher_silence=15)
    herd = LiveHerd(
        ["-c", str(path), "--grace", "3", "chatty.py", "--seconds", "600", "--rate", "2000"],
        home,
        testbed,
    )
    herd.wait_for(r"rank 1 line \d+", 180)
    time.sleep(5)  # a few MB in flight
    job = job_id(home)
    testbed.partition("node3")
    cut = time.monotonic()
    on_node3: list[int] = []
    try:
        while time.monotonic() - cut < 15 + 3 + 40:  # silence + grace + a loaded machine's slack
            on_node3 = [
                pid
                for pid in testbed.processes_with_env("HERD_JOB_ID", job)
                if {b"HERD_NODE=node3", b"RANK=1"} <= set(_environ(pid).split(b"\0"))
            ]
            if not on_node3:
                break
            time.sleep(0.5)
        gone_after = time.monotonic() - cut
        assert not on_node3, (
            f"node3's workers {on_node3} still run {gone_after:.0f} s after the cut"
        )
        herd.finish(timeout=180)
    finally:
        testbed.heal("node3")
    out = herd.output
    assert "node3 stopped answering" in out, out
    herd.assert_clean(["node2", "node3"], settle=30)


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""
