"""The console after herd's verdict, on the testbed: a hung job (a rank frozen with SIGSTOP)
and a failed one (a rank raises ValueError while the other waits in its all-reduce). torch's
agents and ranks die noisily as herd stops them (the agent's "Sending process N closing
signal", C++ frames from the store herd closed, c10d's reverse-lookup warning); the console
shows herd's verdict and summary and none of that, while the job's log files keep every line.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from tests.integration.herd_cli import herd
from tests.integration.herd_cli import one_worker_cluster as cluster
from tests.integration.live import LiveHerd, job_id, pids, resume
from tests.testbed import Testbed
from torchherd.noise import ALWAYS

# What must never reach the console, whatever torch prints: its C++ frames and its agents'
# shutdown lines.
NEVER_SHOWN = re.compile(
    r"frame #\d+:|Exception raised from|death signal|closing signal SIG|To enable traceback"
    r"|hostname of the client socket"
)


def kept_in_logs(home: Path, job: str) -> str:
    """Every line the job's log files keep (output.log has every rank's and node's)."""
    return (home / "jobs" / job / "output.log").read_text(errors="replace")


def assert_quiet_console(console: str, logs: str) -> None:
    shown = [line for line in console.splitlines() if NEVER_SHOWN.search(line)]
    assert not shown, "\n".join(shown)
    noise = [line for line in logs.splitlines() if ALWAYS.search(line)]
    assert noise, "torch printed none of its known chatter this time:\n" + logs[-3000:]


def test_a_hung_jobs_console_is_herds_verdict_not_torchs_teardown(
    testbed: Testbed, tmp_path: Path
) -> None:
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    live = LiveHerd(["-c", str(path), "--grace", "3", "steps.py", "--quiet"], home, testbed)
    stepping = live.wait_for(r"STEPPING rank=(?P<rank>\d) pid=(?P<pid>\d+)", 120, count=2)
    victim = next(m for m in stepping if m.group("rank") == "1")
    os.kill(pids(victim), signal.SIGSTOP)
    try:
        live.wait_for(r"the job is hung", 120)
        code = live.finish()
    finally:
        resume(pids(victim))
    console = live.output
    assert code == 1, console
    assert "the job is hung: node2 rank 1 stopped" in console
    assert_quiet_console(console, kept_in_logs(home, job_id(home)))
    live.assert_clean(["node1", "node2"])


def test_a_failed_jobs_console_shows_the_error_not_torchs_teardown(
    testbed: Testbed, tmp_path: Path
) -> None:
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    run = herd(
        ["launch", "-c", str(path), "bad_value.py", "--max-steps", "80", "--snapshot-every",
         "20", "--batch-size", "16", "--run-dir", str(tmp_path / "run")],
        home, tmp_path, timeout=300,
    )  # fmt: skip
    console = run.stdout + run.stderr
    assert run.returncode == 1, console
    assert "first failure: node2 rank 1" in console, console
    assert "ValueError: bad value 42" in console, console
    assert_quiet_console(console, kept_in_logs(home, job_id(home)))
