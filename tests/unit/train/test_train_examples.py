"""The examples run as a user runs them: under torchrun and under plain python, and they resume."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
from train_helpers import EXAMPLES, read_metrics, run_checked, torchrun_argv


def test_minimal_under_torchrun_resumes(tmp_path: Path) -> None:
    script = EXAMPLES / "minimal.py"
    args = ["--snapshot-every", "5", "--run-dir", str(tmp_path), "--log-every", "5"]
    first = run_checked(torchrun_argv(2, script, ["--max-steps", "10", *args]))
    assert "step 10/10" in first.stdout
    second = run_checked(torchrun_argv(2, script, ["--max-steps", "15", *args]))
    assert "resumed from" in second.stdout and "step-10" in second.stdout
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 16))
    assert records[-1]["loss"] < records[0]["loss"]


def test_gpt_under_plain_python_learns(tmp_path: Path) -> None:
    done = run_checked(
        [
            sys.executable,
            str(EXAMPLES / "gpt.py"),
            "--max-steps", "40", "--snapshot-every", "20", "--eval-every", "20",
            "--run-dir", str(tmp_path), "--lr", "3e-3",
        ]
    )  # fmt: skip
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all(r["tokens_per_s"] > 0 for r in records if "samples_per_s" in r)
    vocab = len(set((EXAMPLES / "data" / "tiny.txt").read_text()))
    # Starts near uniform guessing (ln vocab), and learns.
    assert abs(records[0]["loss"] - math.log(vocab)) < 0.5
    assert records[-1]["loss"] < records[0]["loss"] - 0.8
    assert "sample: " in done.stdout
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == [
        "latest",
        "step-20",
        "step-40",
    ]


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("transformers", "peft")),
    reason="transformers and peft are not installed (pip install 'torchherd[hf]')",
)
def test_hf_trainer_example_runs_and_resumes(tmp_path: Path) -> None:
    script = str(EXAMPLES / "hf_trainer.py")
    args = ["--snapshot-every", "3", "--run-dir", str(tmp_path)]
    first = run_checked([sys.executable, script, "--max-steps", "3", *args])
    assert "done: 3 steps, from the start" in first.stdout  # not "resumed from None"
    resumed = run_checked(torchrun_argv(2, Path(script), ["--max-steps", "6", *args]))
    assert "resumed from" in resumed.stdout and "checkpoint-3" in resumed.stdout
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 7))
