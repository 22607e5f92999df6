"""Where a start went (startup.py): the breakdown from marks, the marks a worker and its node's
agent write and read (real files, a real worker interpreter with torch's process group)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchherd import progress
from torchherd.agent.attempt import StartMarks
from torchherd.exit_guard import for_workers
from torchherd.startup import FIRST_START, RESTART, breakdown, node_marks, render


def first_start_marks() -> dict[str, dict[str, float]]:
    # gpu2 connects late; gpu1 reaches the rendezvous last; gpu2's script starts slowly.
    return {
        "gpu1": {
            "launcher": 0.3, "connected": 0.5, "agent": 0.9, "probed": 1.2, "requested": 2.0,
            "ready": 3.0, "workers": 5.5, "pg-begin": 7.0, "pg-end": 7.4, "first-step": 8.0,
        },
        "gpu2": {
            "launcher": 0.3, "connected": 1.1, "agent": 1.4, "probed": 1.6, "requested": 2.0,
            "ready": 2.6, "workers": 5.4, "pg-begin": 7.2, "pg-end": 7.4, "first-step": 7.9,
        },
    }  # fmt: skip


def test_the_jobs_phases_sum_to_its_total_and_name_each_phases_slowest_node() -> None:
    found = breakdown(0.0, first_start_marks(), FIRST_START, restart=False)
    assert list(found["phases"]) == [
        "launcher start", "ssh connect", "agent start", "probe", "plan", "wrapper warm",
        "rendezvous", "script start", "process-group init", "first step",
    ]  # fmt: skip
    assert found["total"] == pytest.approx(8.0)
    assert sum(found["phases"].values()) == pytest.approx(found["total"], abs=0.01)
    assert found["complete"] is True
    slowest = found["slowest"]
    assert slowest["ssh connect"] == "gpu2"  # 0.8 s against 0.2 s
    assert slowest["wrapper warm"] == "gpu1"  # 1.0 s against 0.6 s
    assert slowest["rendezvous"] == "gpu1"  # a phase all wait through: the last one in
    assert slowest["script start"] == "gpu2"
    for host, phases in found["nodes"].items():
        own_end = first_start_marks()[host]["first-step"]
        assert sum(phases.values()) == pytest.approx(own_end, abs=0.01), host
    lines = render(found, 0, restart=False)
    assert lines[0] == "herd: start: 8.00 s to the first step"
    assert any("ssh connect" in line and "slowest gpu2 (0.80 s)" in line for line in lines)


def test_a_missing_mark_merges_its_phase_into_the_next_and_a_restart_is_named_so() -> None:
    # A script that never calls init_process_group; a restart in place.
    marks = {
        "gpu1": {"stopped": 0.4, "requested": 0.6, "ready": 0.7, "workers": 2.0, "first-step": 3.5},
        "gpu2": {"stopped": 0.2, "requested": 0.6, "ready": 0.9, "workers": 2.1},
    }
    found = breakdown(0.0, marks, RESTART, restart=True)
    assert list(found["phases"]) == [
        "stop", "replan", "wrapper warm", "rendezvous",
        "script start + process-group init + first step",
    ]  # fmt: skip
    assert found["complete"] is False  # gpu2 never made its first step
    assert sum(found["phases"].values()) == pytest.approx(found["total"]) == 3.5
    assert render(found, 1, restart=True)[0] == (
        "herd: restart (attempt 1): 3.50 s and no first step on every node"
    )


def test_node_marks_are_read_against_the_started_events_clock_not_the_launchers() -> None:
    # The node's clock is 100 s ahead: its marks land where its "started" event arrived.
    placed = node_marks({"ready": 1100.5, "worker": 1102.0, "other": 1.0}, 1100.0, 20.0)
    assert placed == {"ready": pytest.approx(20.5), "workers": pytest.approx(22.0)}


@pytest.fixture
def fresh_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(progress.PROGRESS_DIR_VAR, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    module = importlib.reload(progress)
    yield module
    importlib.reload(progress)


def test_the_first_beat_with_a_step_marks_the_first_step_once(
    tmp_path: Path, fresh_progress
) -> None:  # type: ignore[no-untyped-def]
    fresh_progress.mark("ready", wrapper=True)
    fresh_progress.beat(now=True)  # a phase's end before any step: not the first step
    assert "first-step" not in fresh_progress.read_marks(str(tmp_path)).get("1", {})
    fresh_progress.beat(0, now=True)
    first = fresh_progress.read_marks(str(tmp_path))["1"]["first-step"]
    fresh_progress.beat(1, now=True)
    marks = fresh_progress.read_marks(str(tmp_path))
    assert marks["1"] == {"first-step": first}
    assert set(marks["wrapper"]) == {"ready"}


def test_the_agent_sends_each_nodes_latest_rank_and_stops_looking_after_the_first_step(
    tmp_path: Path,
) -> None:
    (tmp_path / "wrapper.start").write_text("ready 10.0\n")
    (tmp_path / "rank-0.start").write_text("worker 11.0\npg-begin 12.0\n")
    (tmp_path / "rank-1.start").write_text("worker 11.5\npg-begin 12.5\n")
    sent: list[dict[str, object]] = []
    marks = StartMarks(str(tmp_path), "0", sent.append)
    marks.report()
    marks.report()  # nothing new: nothing sent
    assert sent == [
        {
            "e": "marks", "a": "0", "ranks": 2,
            "m": {"ready": 10.0, "worker": 11.5, "pg-begin": 12.5},
        }
    ]  # fmt: skip
    (tmp_path / "rank-0.start").write_text("worker 11.0\npg-begin 12.0\nfirst-step 13.0\n")
    (tmp_path / "rank-1.start").write_text("worker 11.5\npg-begin 12.5\nfirst-step 13.2\n")
    marks.report()
    assert sent[-1]["m"] == {"ready": 10.0, "worker": 11.5, "pg-begin": 12.5, "first-step": 13.2}
    (tmp_path / "rank-0.start").unlink()
    marks.report()  # done: no more looks
    assert len(sent) == 2


WORKER = """
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
from torchherd import progress
progress.beat(0)
dist.destroy_process_group()
"""


def test_a_workers_site_hook_marks_its_start_and_its_process_group_init(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, RANK="0", HERD_JOB_ID="j1", **{progress.PROGRESS_DIR_VAR: str(tmp_path)})
    for_workers(env)  # the workers' PYTHONPATH, as the node's torchrun wrapper sets it
    subprocess.run(
        [sys.executable, "-c", WORKER.format(port=port)], env=env, check=True, timeout=120
    )
    marks = progress.read_marks(str(tmp_path))["0"]
    assert list(marks) == ["worker", "pg-begin", "pg-end", "first-step"], json.dumps(marks)
    assert marks["worker"] < marks["pg-begin"] < marks["pg-end"] <= marks["first-step"]
