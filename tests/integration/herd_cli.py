"""Running the real `herd` command as a subprocess, the way a user does, in integration tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def herd(
    args: list[str], home: Path, cwd: Path, *, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """`herd ARGS` in ``cwd`` with job records under ``home``; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "torchherd", *args],
        cwd=cwd,
        env=dict(os.environ, HERD_HOME=str(home)),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
