"""The Trainer's wait timer (train._timing.WaitTimer) under real torchrun on CPU/Gloo: two
ranks, rank 1 made slower by a sleep in each step or in its data loader. The rank the other
waits for waits least, by about the lag, and a data loader's lag shows as its data time; a
balanced job's ranks wait alike."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from train_helpers import run_checked, torchrun_argv

JOB = Path(__file__).parent / "jobs" / "waits_job.py"
LAG = 0.03


def beats(out: Path, rank: int) -> dict[str, float]:
    """A rank's median wait, cycle and data seconds over its beats, past the first few."""
    records = [
        json.loads(line) for line in (out / f"beats-{rank}.jsonl").read_text().split("\n") if line
    ]
    assert len(records) >= 20, records  # a beat per step, at most every half second written
    kept = records[5:]
    return {k: statistics.median(r[k] for r in kept) for k in ("wait", "cycle", "data")}


def run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str
) -> tuple[dict[str, float], dict[str, float]]:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "progress").mkdir()
    monkeypatch.setenv("HERD_PROGRESS_DIR", str(tmp_path / "progress"))  # beats are written
    argv = torchrun_argv(2, JOB, ["--out", str(out), "--run-dir", str(tmp_path / "run"), *args])
    run_checked(argv, timeout=180)
    return beats(out, 0), beats(out, 1)


@pytest.mark.parametrize("where", ["step", "data"])
def test_the_rank_the_other_waits_for_waits_least(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    fast, slow = run(tmp_path, monkeypatch, "--lag", str(LAG), "--where", where)
    assert fast["wait"] - slow["wait"] > LAG * 0.6, (fast, slow)
    assert slow["cycle"] >= LAG and abs(fast["cycle"] - slow["cycle"]) < LAG / 2, (fast, slow)
    if where == "data":
        assert slow["data"] - fast["data"] > LAG * 0.6, (fast, slow)
    else:
        assert slow["data"] < LAG / 3, (fast, slow)


def test_balanced_ranks_wait_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = run(tmp_path, monkeypatch)
    assert abs(first["wait"] - second["wait"]) < LAG * 0.6, (first, second)
