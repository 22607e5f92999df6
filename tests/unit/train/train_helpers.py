"""Helpers for the torchherd.train tests: real torchrun subprocesses and run folders.

The package may not be installed (tests run from a checkout), so ``src`` is put on the path of
this process and, through PYTHONPATH, of every subprocess the tests start. (A plain module, not
conftest.py, so that no other test folder's conftest can shadow it on import.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
SRC = REPO / "src"
JOBS = Path(__file__).resolve().parent / "jobs"
EXAMPLES = REPO / "examples"

for _path in (SRC, REPO):  # REPO: shared test helpers (tests.s3server)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def subprocess_env() -> dict[str, str]:
    """The environment for child processes: src importable, one thread per worker."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def torchrun_argv(nproc: int, script: Path, args: Sequence[str]) -> list[str]:
    """A standalone torchrun command line (its own rendezvous on a free local port)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]


def run_checked(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a command to completion; fail the test with its output when it fails."""
    done = subprocess.run(
        argv, env=subprocess_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    if done.returncode != 0:
        output = f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        pytest.fail(f"{argv} exited {done.returncode}\n{output}")
    return done


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The training records of metrics.jsonl (evaluation records left out)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]
