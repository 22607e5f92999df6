"""Running the real `herd` command as a subprocess, the way a user does, in integration tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.testbed import Testbed

SCRIPTS = Path(__file__).parent / "scripts"


def herd(
    args: list[str],
    home: Path,
    cwd: Path,
    *,
    timeout: float = 180,
    python: str | Path = sys.executable,
) -> subprocess.CompletedProcess[str]:
    """`herd ARGS` in ``cwd`` with job records under ``home``, run by ``python`` (this
    suite's by default); output captured as text."""
    return subprocess.run(
        [str(python), "-m", "torchherd", *args],
        cwd=cwd,
        env=dict(os.environ, HERD_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def one_worker_cluster(
    testbed: Testbed, tmp_path: Path, hosts: list[str], **keys: object
) -> tuple[Path, Path]:
    """A herd.toml for ``hosts`` with one worker each, running tests/integration/scripts;
    returns it and the HERD_HOME its jobs (launcher and nodes) use."""
    home = tmp_path / "home"
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[{"host": h, "nproc": 1} for h in hosts],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
        **keys,
    )
    return path, home
