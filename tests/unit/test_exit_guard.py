"""herd's workers wait at exit with the GIL free, so Gloo's threads can finish releasing the
last collectives before the interpreter shuts down (torchherd/exit_guard.py says why). torch
itself installs the wait, through the package's "torch.backends" entry point: these tests
import torch in fresh interpreters, as a worker and as other processes, and count the exit
handlers it registered."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

COUNT = (
    "import atexit; before = atexit._ncallbacks(); import torch; "
    "print(atexit._ncallbacks() - before)"
)


def handlers_registered_by_import_torch(**env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if k not in ("HERD_JOB_ID", "RANK")}
    done = subprocess.run(
        [sys.executable, "-c", COUNT],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def baseline() -> int:
    """What torch registers by itself in a process herd did not start."""
    return handlers_registered_by_import_torch()


def test_a_herd_worker_gets_the_wait_at_exit(baseline: int) -> None:
    assert handlers_registered_by_import_torch(HERD_JOB_ID="job", RANK="0") == baseline + 1


def test_torchruns_own_agent_and_other_processes_do_not(baseline: int) -> None:
    # torchrun's agent (herd's wrapper) has the job id but no RANK; a user's own python neither.
    assert handlers_registered_by_import_torch(HERD_JOB_ID="job") == baseline
    assert handlers_registered_by_import_torch(RANK="0") == baseline


def test_a_workers_exit_handlers_do_wait() -> None:
    script = (
        "import atexit; import torch\n"
        "import torchherd.exit_guard as guard\n"
        "waits = []\n"
        "guard.let_threads_finish = lambda: waits.append(1)\n"
        "atexit._run_exitfuncs(); print(len(waits))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=dict(os.environ, HERD_JOB_ID="job", RANK="0"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.split()[-1] == "1", done.stderr
