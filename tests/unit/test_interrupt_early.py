"""Ctrl-C while herd is still importing its own modules (typer, rich, its command: a fifth
of a second) ends herd quietly with "herd: interrupted" and exit 130, never a traceback.

The interrupt is delivered at an exact point: a finder put first on ``sys.meta_path`` sends
SIGINT to the process when herd starts importing the named module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TRIP = """\
import os, signal, sys
target = sys.argv[1]
class Trip:
    def find_spec(self, name, path, target_=None):
        if name == target:
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Trip())
sys.argv = ["herd", *sys.argv[2:]]
from torchherd.cli import run
run()
"""


@pytest.mark.parametrize(
    ("module", "command"),
    [
        ("typer", ["ps"]),
        ("rich.console", ["ps"]),
        # imported only by the commands that need it (a launch reads the cluster)
        ("torchherd.spec", ["launch", "--dry-run", "train.py"]),
        ("torchherd.cli.jobs", ["ps"]),  # a command imports its own module only
        ("torchherd.records", ["ps"]),
    ],
)
def test_ctrl_c_while_herd_imports_is_quiet(
    module: str, command: list[str], tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", TRIP, module, *command],
        env=dict(os.environ, HERD_HOME=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == "herd: interrupted"
    # 130, or death by SIGINT (which shells report as 130): CPython 3.11 re-raises SIGINT at
    # exit when the interrupt hit code run by exec(), as dataclasses' generated methods are.
    assert done.returncode in (130, -2)
