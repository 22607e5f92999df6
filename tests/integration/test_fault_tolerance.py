"""Fault tolerance end to end: a worker SIGKILLed after a snapshot costs a restart, not the run.

`herd launch --max-restarts 1` of examples/minimal.py on two testbed nodes; one worker on node2
is killed after the first snapshots exist; herd restarts the whole job (attempt 1), the Trainer
resumes from the latest snapshot, not from an older one nor from step 0, and every step's loss
equals that of a run never interrupted, each step recorded once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.training import ARGS, losses, worker_on
from tests.testbed import Testbed

SCRIPTS = Path(__file__).parent / "scripts"


def snapshot_steps(run_dir: Path) -> list[int]:
    folder = run_dir / "snapshots"
    found = (
        [re.fullmatch(r"step-(\d+)", p.name) for p in folder.iterdir()] if folder.exists() else []
    )
    return sorted(int(m.group(1)) for m in found if m)


def attempts(out: str) -> list[tuple[str, str]]:
    return re.findall(r"ATTEMPT rank=(\d+) attempt=(\S+)", out)


def launch(testbed: Testbed, tmp_path: Path, name: str) -> tuple[subprocess.Popen[str], Path, Path]:
    home = tmp_path / name / "home"
    home.mkdir(parents=True)
    path = testbed.write_cluster_file(
        tmp_path / name / "herd.toml",
        nodes=[{"host": "node1", "nproc": 1}, {"host": "node2", "nproc": 1}],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
    )
    run_dir = tmp_path / name / "run"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchherd",
            "launch",
            "-c",
            str(path),
            "--max-restarts",
            "1",
            "slow_minimal.py",
            *ARGS,
            "--run-dir",
            str(run_dir),
        ],
        cwd=SCRIPTS,
        env=dict(os.environ, HERD_HOME=str(home)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, home, run_dir


def test_killed_worker_resumes_to_the_same_loss(testbed: Testbed, tmp_path: Path) -> None:
    straight, _, straight_dir = launch(testbed, tmp_path, "straight")
    out = straight.communicate(timeout=300)[0]
    assert straight.returncode == 0, out
    expected = losses(straight_dir)
    assert [step for step, _ in expected] == list(range(1, 201)), "the straight run is not whole"

    process, home, run_dir = launch(testbed, tmp_path, "killed")
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "snapshots" / "step-40").exists():
            assert time.monotonic() < deadline and process.poll() is None, "no snapshot in time"
            time.sleep(0.05)
        job_id = next((home / "jobs").iterdir()).name
        victim = worker_on(job_id, "node2", testbed)
        assert victim is not None, "no worker on node2"
        before_kill = max(snapshot_steps(run_dir))
        os.kill(victim, signal.SIGKILL)
        out = process.communicate(timeout=300)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, out
    # Both ranks ran twice: attempt 0, then herd's restart, attempt 1.
    assert sorted(attempts(out)) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], out
    # The restarted attempt resumed, from the last snapshot before the kill or a later one.
    resumed = re.findall(r"resumed from \S*/snapshots/step-(\d+)", out)
    assert len(resumed) == 1, out
    assert int(resumed[0]) >= before_kill >= 40, (resumed, before_kill)
    # Each step recorded once (the steps redone after the resume replace the lost ones), and
    # every loss is the uninterrupted run's.
    assert losses(run_dir) == expected
