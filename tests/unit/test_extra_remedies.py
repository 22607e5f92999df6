"""A missing optional package says which extra to install, wherever it is found missing: an
error herd raises inside a training script shows its fix under the traceback."""

from __future__ import annotations

import os
import subprocess
import sys

from torchherd.errors import ConfigError

BLOCKED = """\
import sys
sys.modules["wandb"] = None  # `import wandb` now fails as where it is not installed
from torchherd.train.trackers import check_installed
check_installed(["wandb"])  # what the Trainer calls before training
"""


def test_a_tracker_without_its_package_prints_the_pip_line() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED],
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert "wandb package is not installed" in lines[-2]
    assert lines[-1] == "fix: pip install 'torchherd[wandb]', or remove wandb from trackers"


def test_every_herd_error_carries_its_fix_into_tracebacks() -> None:
    import traceback

    error = ConfigError("bad thing", "do the good thing")
    shown = "".join(traceback.format_exception(error))
    assert shown.endswith("ConfigError: bad thing\nfix: do the good thing\n")
    assert str(error) == "bad thing"  # messages themselves are unchanged
