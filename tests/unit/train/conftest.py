"""Fixtures for the torchherd.train tests (helpers live in train_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_helpers import JOBS


@pytest.fixture
def job_script() -> Path:
    """The Trainer job that the torchrun tests launch."""
    return JOBS / "train_job.py"
