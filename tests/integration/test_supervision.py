"""Supervision that never kills a healthy job: busy, quiet and slow jobs on the testbed, a
launcher that stalls, signals at awkward moments, and Ctrl-C twice.

Each test asserts what herd itself reports (and what it must never say: "hung", "stopped
answering"), the job record, and, under the process watch, that nothing herd started is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.herd_cli import one_worker_cluster as cluster
from tests.integration.live import LiveHerd, job_id, stacks_of
from tests.integration.procs import cmdline, environ, parent_of, running
from tests.testbed import Testbed
from torchherd.agent.workers import process_state


def test_a_job_that_only_beats_outlives_its_limit(testbed: Testbed, tmp_path: Path) -> None:
    """No output after start-up for three times the plain limit: its beats keep it alive."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(
        ["-c", str(path), "--hang-timeout", "5", "steps.py", "--quiet", "--steps", "300"],
        home,
        testbed,
    )
    code = herd.finish(timeout=240)
    out = herd.output
    assert code == 0, out
    assert "hung" not in out, out
    assert herd.record()["attempts"][-1]["outcome"] == "succeeded"
    herd.assert_clean(["node1", "node2"])


def test_a_quiet_link_does_not_lose_a_node_whose_ranks_still_step(
    testbed: Testbed, tmp_path: Path
) -> None:
    """node2's agent is stopped (SIGSTOP) for about 18 s while its rank trains on: nothing
    comes over its link for three times link_silence (6 s here: an agent starting torchrun
    on a machine running three testbeds was seen silent for 4 s), yet node1's rank keeps
    stepping, which its all-reduces with node2's rank prove. node2 is not lost: herd says why
    once, and the job ends as it would have."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"], link_silence=6)
    herd = LiveHerd(["-c", str(path), "steps.py", "--quiet", "--steps", "500"], home, testbed)
    (found,) = herd.wait_for(r"STEPPING rank=1 pid=(\d+)", 180)
    agent = _agent_of(int(found.group(1)))
    os.kill(agent, signal.SIGSTOP)
    try:
        herd.wait_for(r"node2 has said nothing for \d+ s, but the other nodes' ranks still", 60)
        time.sleep(12)
    finally:
        os.kill(agent, signal.SIGCONT)
    code = herd.finish(timeout=180)
    out = herd.output
    assert code == 0, out
    assert "not lost for a quiet link alone" in out, out
    assert "stopped answering" not in out and "hung" not in out, out
    herd.assert_clean(["node1", "node2"])


def _agent_of(worker: int) -> int:
    """The node agent above a worker (its torchrun's parent): `python -m torchherd.agent`."""
    pid = worker
    for _ in range(6):
        pid = parent_of(pid)
        if b"torchherd.agent" in (cmdline(pid) or b"").split(b"\0"):
            return pid
    raise AssertionError(f"no agent above worker {worker}")


def test_busy_quiet_and_slow_to_stop_is_never_hung_or_lost(
    testbed: Testbed, tmp_path: Path
) -> None:
    """Default settings. After a few steps every rank computes for 28 s printing nothing, then
    rank 0 writes to disk for 28 s while rank 1 waits in a barrier, printing nothing (each
    past the earliest hang verdict, 20 s into a silence); then the
    job is stopped (Ctrl-C) and every rank's SIGTERM handler takes 15 s (more than the 10 s of
    silence that make a node lost) with --grace 30. herd must call none of it hung, and no
    node lost or cut off: each stops, saying alive all along, and its handler finishes."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(
        [
            "-c",
            str(path),
            "--grace",
            "30",
            "phases.py",
            "--compute",
            "28",
            "--save",
            "28",
            "--linger",
            "--sigterm-delay",
            "15",
        ],
        home,
        testbed,
    )
    herd.wait_for(r"LINGERING rank=\d", 300, count=2)
    herd.signal(signal.SIGINT)
    code = herd.finish(timeout=120)
    out = herd.output
    assert code == 130, out
    assert "SIGTERM rank=0 done after 15 s" in out and "SIGTERM rank=1 done after 15 s" in out
    for never in ("hung", "stopped answering", "cutting it off", "lost contact"):
        assert never not in out, f"herd said {never!r}:\n{out}"
    assert re.search(r"node1\s+stopped", out) and re.search(r"node2\s+stopped", out), out
    assert herd.record()["attempts"][-1]["outcome"] == "interrupted"
    herd.assert_clean(["node1", "node2"])


def test_a_plain_script_saves_when_asked_and_herd_exits_5(testbed: Testbed, tmp_path: Path) -> None:
    """SIGUSR1 (a scheduler's time-limit warning) to herd: a plain script, no Trainer, sees
    torchherd.progress.save_requested(), saves, reports it with progress.saved(step) and ends;
    herd exits 5 (saved: requeue me) and records the state as saved."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(["-c", str(path), "steps.py", "--save-on-request"], home, testbed)
    herd.wait_for(r"STEPPING rank=1", 120)
    herd.signal(signal.SIGUSR1)
    code = herd.finish(timeout=120)
    out = herd.output
    assert code == 5, out
    saved = re.search(r"SAVED step=(\d+)", out)
    assert saved, out
    assert "saved a snapshot and stopped" in out, out
    record = herd.record()
    assert record["state"] == "saved", record
    assert record["attempts"][-1]["outcome"] == "saved", record
    herd.assert_clean(["node1", "node2"])


def test_a_save_that_never_comes_ends_with_the_workers_stacks(
    testbed: Testbed, tmp_path: Path
) -> None:
    """SIGUSR1 to herd while the script never saves (it ignores the request): once the save
    window is over (5 s: --time-grace 16 less --grace 1 and herd's 10 s) herd says no snapshot
    came, takes every worker's stacks, then stops the job: it failed, with the reason and the
    evidence of where each rank was (steps.py's loop), not a bare stop."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(
        ["-c", str(path), "--time-grace", "16", "--grace", "1", "steps.py", "--quiet"],
        home,
        testbed,
    )
    herd.wait_for(r"STEPPING rank=1", 120)
    herd.signal(signal.SIGUSR1)
    code = herd.finish(timeout=120)
    out = herd.output
    assert code == 1, out
    assert "herd: no snapshot came within 5 s of the request" in out, out
    assert "taking the workers' stacks on 2 node(s) before stopping the job" in out, out
    assert "the time limit came and no snapshot was reported committed" in out, out
    stacks = stacks_of(home, job_id(home))
    for name in ("node1-rank-0.txt", "node2-rank-1.txt"):
        assert "steps.py" in stacks.get(name, ""), stacks
    herd.assert_clean(["node1", "node2"])


def test_a_stalled_launcher_blames_no_node(testbed: Testbed, tmp_path: Path) -> None:
    """herd stopped for 20 s (SIGSTOP: a Ctrl-Z, a paused VM) and resumed: the nodes kept the
    job running (they wait 90 s for a silent launcher), herd says it was away, blames no node
    and the job finishes."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(["-c", str(path), "steps.py", "--steps", "600"], home, testbed)
    herd.wait_for(r"STEPPING rank=1", 120)
    herd.signal(signal.SIGSTOP)
    time.sleep(20)
    herd.signal(signal.SIGCONT)
    code = herd.finish(timeout=240)
    out = herd.output
    assert code == 0, out
    found = re.search(r"this launcher did not run for (\d+) s", out)
    assert found and int(found.group(1)) >= 15, out
    assert "stopped answering" not in out and "hung" not in out, out
    assert [a["outcome"] for a in herd.record()["attempts"]] == ["succeeded"]
    herd.assert_clean(["node1", "node2"])


def test_a_job_its_agents_stopped_for_a_silent_launcher_restarts(
    testbed: Testbed, tmp_path: Path
) -> None:
    """The agents hear nothing for longer than launcher_silence (8 s here) and stop the job
    themselves; on its return herd says so and starts the job again in place, although no
    restart was allowed (--max-restarts 0): the job did not fail."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"], launcher_silence=8)
    herd = LiveHerd(["-c", str(path), "steps.py", "--steps", "300"], home, testbed)
    herd.wait_for(r"STEPPING rank=1", 120)
    herd.signal(signal.SIGSTOP)
    time.sleep(20)
    herd.signal(signal.SIGCONT)
    code = herd.finish(timeout=240)
    out = herd.output
    assert code == 0, out
    assert re.search(r"agent stopped the job: it heard nothing from this launcher for 8 s", out)
    assert "attempt 1 in place" in out, out
    assert "stopped answering" not in out, out
    attempts = herd.record()["attempts"]
    assert [a["outcome"] for a in attempts] == ["stopped by its agents", "succeeded"], attempts
    assert attempts[1]["how"] == "in place", attempts
    herd.assert_clean(["node1", "node2"])


def time_limit_during_a_restart(
    testbed: Testbed, tmp_path: Path, *script_args: str
) -> tuple[LiveHerd, int, str]:
    """SIGUSR1 while a failed attempt is torn down (rank 1 fails, rank 0 takes 10 s to stop):
    herd, its exit code and its output, after checking that no attempt started after it."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(
        ["-c", str(path), "--max-restarts", "3", "--grace", "20", "phases.py", *script_args]
        + ["--fail-rank", "1", "--sigterm-delay", "10"],
        home,
        testbed,
    )
    herd.wait_for(r"node2 failed; stopping the other nodes", 120)
    herd.signal(signal.SIGUSR1)
    code = herd.finish(timeout=120)
    out = herd.output
    assert "the time limit came while the job was restarting" in out, out
    assert "restarting the job (restart" not in out and "attempt 1" not in out, out
    return herd, code, out


def test_a_time_limit_during_a_restart_starts_nothing_more(
    testbed: Testbed, tmp_path: Path
) -> None:
    """No attempt starts after the limit, and since no snapshot was committed herd does not
    claim one (exit 1, not 5)."""
    herd, code, out = time_limit_during_a_restart(testbed, tmp_path)
    assert code == 1, out
    assert len(herd.record()["attempts"]) == 1
    herd.assert_clean(["node1", "node2"])


def test_a_time_limit_during_a_restart_exits_5_when_a_snapshot_stands(
    testbed: Testbed, tmp_path: Path
) -> None:
    """The same limit during the same teardown, from a job that reported a committed snapshot
    before it failed: herd exits 5 (requeue me): the last snapshot stands."""
    herd, code, out = time_limit_during_a_restart(testbed, tmp_path, "--report-saved")
    assert code == 5, out
    assert "the last committed snapshot stands" in out, out
    assert herd.record()["state"] == "saved"
    herd.assert_clean(["node1", "node2"])


def test_the_second_ctrl_c_kills_at_once_and_leaves_nothing(
    testbed: Testbed, tmp_path: Path
) -> None:
    """Workers that ignore SIGTERM: the first Ctrl-C would wait out the 60 s grace period;
    the second kills every worker now, and herd leaves only once the nodes say so."""
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    herd = LiveHerd(
        ["-c", str(path), "--grace", "60", "phases.py", "--ignore-sigterm", "--idle"],
        home,
        testbed,
    )
    stepping = herd.wait_for(r"STEPPING rank=(?P<rank>\d) pid=(?P<pid>\d+)", 120, count=2)
    workers = [int(m.group("pid")) for m in stepping]
    herd.signal(signal.SIGINT)
    herd.wait_for(r"stopping the job on every node", 30)
    time.sleep(1)
    assert all(Path(f"/proc/{pid}").exists() for pid in workers)  # SIGTERM was ignored
    herd.signal(signal.SIGINT)
    herd.wait_for(r"killing the job on every node", 30)
    code = herd.finish(timeout=60)
    out = herd.output
    assert code == 130, out
    # Killed: none runs (one may wait, a zombie, for the init that adopted it to reap it).
    assert not [pid for pid in workers if running(pid)], out
    herd.assert_clean(["node1", "node2"])
    listed = subprocess.run(
        [sys.executable, "-m", "torchherd", "ps", "--all"],
        env=dict(os.environ, HERD_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert re.search(r"\bstopped\b", listed.stdout), listed.stdout + listed.stderr


def test_the_second_ctrl_c_on_this_machine_leaves_nothing(tmp_path: Path) -> None:
    """The same with the local transport (no ssh): the agent is herd's own child."""
    home = tmp_path / "home"
    herd = LiveHerd(
        ["--nproc", "2", "--grace", "60", "phases.py", "--ignore-sigterm", "--idle"], home
    )
    stepping = herd.wait_for(r"STEPPING rank=(?P<rank>\d) pid=(?P<pid>\d+)", 120, count=2)
    job = next((home / "jobs").iterdir()).name
    herd.signal(signal.SIGINT)
    herd.wait_for(r"stopping the job on every node", 30)
    herd.signal(signal.SIGINT)
    code = herd.finish(timeout=60)
    assert code == 130, herd.output
    left = [
        pid for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()) if _tagged(pid, job)
    ]
    assert not left, f"left running: {left}\n{herd.output}"
    states = [process_state(int(m.group("pid"))) for m in stepping]
    assert all(state in ("?", "Z") for state in states), states  # gone (or a corpse)


def _tagged(pid: int, job: str) -> bool:
    return f"HERD_JOB_ID={job}".encode() in environ(pid)
