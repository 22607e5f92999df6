"""What a rank's beat file says, through the real progress files the node agent reads.

Beats are written at most twice a second, so a short run's last steps fall between writes;
the end of a phase (a save, the final snapshot) writes at once and must carry the newest step
given, not "-": the job's record takes a node's last step and step rate from these files.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from torchherd import progress


@pytest.fixture
def fresh_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(progress.PROGRESS_DIR_VAR, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    module = importlib.reload(progress)  # a new worker process: nothing beaten yet
    yield module
    importlib.reload(progress)


def test_a_phase_end_writes_at_once_with_the_newest_step(tmp_path: Path, fresh_progress) -> None:  # type: ignore[no-untyped-def]
    fresh_progress.beat(10, compute=0.25)
    assert fresh_progress.read_progress(str(tmp_path))[3].step == 10
    fresh_progress.beat(11)  # inside the half second: not written
    fresh_progress.beat(12)
    assert fresh_progress.read_progress(str(tmp_path))[3].step == 10
    with fresh_progress.phase("final save"):
        assert fresh_progress.read_progress(str(tmp_path))[3].phase == "final save"
    seen = fresh_progress.read_progress(str(tmp_path))[3]
    assert seen.phase is None
    assert seen.step == 12  # the end of the phase carried step 12, given between writes
    assert seen.compute is None


def test_a_beat_without_a_step_before_any_step_says_none(tmp_path: Path, fresh_progress) -> None:  # type: ignore[no-untyped-def]
    fresh_progress.beat()
    assert fresh_progress.read_progress(str(tmp_path))[3].step is None


def test_a_beat_carries_the_mean_compute_of_the_steps_since_the_last_write(
    tmp_path: Path,
    fresh_progress,  # type: ignore[no-untyped-def]
) -> None:
    # A rank held by a CPU quota is paused in bursts: one step in three lands on a pause. The
    # file must show the steps' mean, not whichever step happened to be written.
    fresh_progress.beat(1, compute=0.010)
    assert fresh_progress.read_progress(str(tmp_path))[3].compute == pytest.approx(0.010)
    for step, seconds in ((2, 0.010), (3, 0.080), (4, 0.010)):
        fresh_progress.beat(step, compute=seconds)  # inside the half second: not written
    fresh_progress.beat(now=True)
    seen = fresh_progress.read_progress(str(tmp_path))[3]
    assert seen.step == 4
    assert seen.compute == pytest.approx(0.100 / 3, abs=1e-6)  # written to the microsecond
    fresh_progress.beat(now=True)  # no step computed since: no compute to report
    assert fresh_progress.read_progress(str(tmp_path))[3].compute is None
