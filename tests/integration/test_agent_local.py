"""The node agent on this machine (no testbed needed): it reaps the orphans a worker leaves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"


def test_agent_reaps_orphans_of_its_workers(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torchherd", "launch", "--nproc", "1", "orphans.py"],
        cwd=SCRIPTS,
        env=dict(os.environ, HERD_HOME=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"ZOMBIES (\d+) under agent", done.stdout)
    assert found is not None, done.stdout
    assert int(found.group(1)) == 0, done.stdout
