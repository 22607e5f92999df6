"""What the training-job tests share: the slowed Trainer job's arguments and how its results
are read (metrics.jsonl, the worker on a node to kill)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.herd_cli import SCRIPTS, herd, one_worker_cluster
from tests.integration.procs import environ
from tests.testbed import Testbed

# tests/integration/scripts/slow_minimal.py: 200 steps, a snapshot every 20.
ARGS = ["--max-steps", "200", "--snapshot-every", "20", "--batch-size", "16"]


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every training record in metrics.jsonl, in file order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(int(r["step"]), float(r["loss"])) for r in records if "loss" in r]


def final_loss(run_dir: Path) -> float:
    """The loss logged at step 200 (the last one logged for it, after any resume)."""
    last = [loss for step, loss in losses(run_dir) if step == 200]
    assert last, f"step 200 never logged in {run_dir}"
    return last[-1]


def worker_on(job_id: str, node: str, testbed: Testbed) -> int | None:
    """The pid of local rank 0 of the job on ``node``."""
    for pid in testbed.processes_with_env("HERD_JOB_ID", job_id):
        if {f"HERD_NODE={node}".encode(), b"LOCAL_RANK=0"} <= environ(pid):
            return pid
    return None


def run_uninterrupted(testbed: Testbed, tmp_path: Path) -> list[tuple[int, float]]:
    """Every step's loss of the slowed Trainer job (ARGS) on node1 and node2, one worker each,
    run once without a fault: the reference a recovered run must match step for step."""
    path, home = one_worker_cluster(testbed, tmp_path, ["node1", "node2"])
    run_dir = tmp_path / "run"
    done = herd(
        ["launch", "-c", str(path), "slow_minimal.py", *ARGS, "--run-dir", str(run_dir)],
        home,
        SCRIPTS,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    expected = losses(run_dir)
    assert [step for step, _ in expected] == list(range(1, 201)), "the run is not whole"
    return expected
