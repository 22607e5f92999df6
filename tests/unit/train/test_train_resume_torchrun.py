"""Exact resume under real torchrun on CPU/Gloo: a run killed with SIGKILL and restarted ends
bit-identical to one that was never interrupted, and a job resumed on fewer ranks still sees
every sample of the epoch exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import torch
from train_helpers import read_metrics, run_checked, subprocess_env, torchrun_argv

from torchherd.train import Snapshotter
from torchherd.train.dist import Context

CPU_CTX = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _final_state(run_dir: Path) -> tuple[int, dict]:
    found = Snapshotter(run_dir / "snapshots", ctx=CPU_CTX).load_latest()
    assert found is not None, f"no snapshot in {run_dir}"
    return found


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from /proc (torchrun starts each worker in its own
    session, so killing torchrun's process group would leave the workers running)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _kill_job(proc: subprocess.Popen[bytes]) -> None:
    # Like a machine dying: every process of the job at once, no chance to clean up.
    for pid in [proc.pid, *_descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _kill_when_snapshot(argv: list[str], snapshots: Path, step: int, timeout: float = 90) -> int:
    """Start the job, SIGKILL all its processes once ``latest`` names ``step-<step>``."""
    proc = subprocess.Popen(
        argv,
        env=subprocess_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            latest = Snapshotter(snapshots, ctx=CPU_CTX).latest_step()
            if latest is not None and latest >= step:
                _kill_job(proc)
                return latest
            if proc.poll() is not None:
                raise AssertionError(f"job ended (exit {proc.returncode}) before step {step}")
            time.sleep(0.02)
        raise AssertionError(f"no snapshot of step {step} within {timeout}s")
    finally:
        if proc.poll() is None:
            _kill_job(proc)


def test_killed_and_resumed_run_matches_a_straight_run(tmp_path: Path, job_script: Path) -> None:
    # Every step draws from python's random, numpy's and torch's generators (and dropout).
    common = ["--max-steps", "20", "--snapshot-every", "4", "--draw-every-rng"]
    straight = tmp_path / "straight"
    run_checked(torchrun_argv(2, job_script, ["--run-dir", str(straight), *common]))

    split = tmp_path / "split"
    killed_at = _kill_when_snapshot(
        torchrun_argv(2, job_script, ["--run-dir", str(split), "--step-sleep", "0.15", *common]),
        split / "snapshots",
        step=8,
    )
    assert 8 <= killed_at < 20
    before_resume = read_metrics(split)
    assert before_resume, "the killed run wrote no metrics"
    resumed = run_checked(torchrun_argv(2, job_script, ["--run-dir", str(split), *common]))
    assert f"RESULT resumed_from={killed_at} step=20" in resumed.stdout

    expected = read_metrics(straight)
    got = read_metrics(split)
    assert [r["step"] for r in got] == list(range(1, 21))
    assert [(r["step"], r["loss"], r["lr"]) for r in got] == [
        (r["step"], r["loss"], r["lr"]) for r in expected
    ]
    # What the killed run logged past its last snapshot was redone identically.
    by_step = {r["step"]: r["loss"] for r in expected}
    assert all(by_step[r["step"]] == r["loss"] for r in before_resume)

    step_a, state_a = _final_state(straight)
    step_b, state_b = _final_state(split)
    assert step_a == step_b == 20
    assert state_a["model"].keys() == state_b["model"].keys()
    for key, tensor in state_a["model"].items():
        assert torch.equal(tensor, state_b["model"][key]), key
    # Every generator's full state, on every rank, is the straight run's.
    assert len(state_a["rng"]) == len(state_b["rng"]) == 2
    for rank_a, rank_b in zip(state_a["rng"], state_b["rng"], strict=True):
        assert sorted(rank_a) == sorted(rank_b) and {"python", "numpy", "torch"} <= set(rank_a)
        assert torch.equal(rank_a["torch"], rank_b["torch"])
        assert rank_a["python"] == rank_b["python"]
        numpy_a, numpy_b = rank_a["numpy"], rank_b["numpy"]
        assert torch.equal(numpy_a.pop("keys"), numpy_b.pop("keys")) and numpy_a == numpy_b


def test_fsdp_stopped_and_resumed_matches_a_straight_run(tmp_path: Path, job_script: Path) -> None:
    common = ["--parallel", "fsdp", "--snapshot-every", "3"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_checked(
        torchrun_argv(2, job_script, ["--run-dir", str(straight), "--max-steps", "8", *common])
    )
    run_checked(
        torchrun_argv(2, job_script, ["--run-dir", str(split), "--max-steps", "4", *common])
    )
    resumed = run_checked(
        torchrun_argv(2, job_script, ["--run-dir", str(split), "--max-steps", "8", *common])
    )
    assert "RESULT resumed_from=4 step=8" in resumed.stdout
    expected, got = read_metrics(straight), read_metrics(split)
    assert [(r["step"], r["loss"]) for r in got] == [(r["step"], r["loss"]) for r in expected]
    (_, state_a), (_, state_b) = _final_state(straight), _final_state(split)
    # The snapshot holds full (unsharded) tensors, loadable without FSDP.
    assert state_a["model"]["0.weight"].shape == (64, 16)
    for key, tensor in state_a["model"].items():
        assert torch.equal(tensor, state_b["model"][key]), key


def _consumed(run_dir: Path, ranks: int, up_to: int | None = None) -> list[int]:
    seen: list[int] = []
    for rank in range(ranks):
        for line in (run_dir / f"indices-rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if up_to is None or record["step"] <= up_to:
                seen.extend(record["indices"])
    return seen


def test_resume_on_fewer_ranks_sees_each_sample_once(tmp_path: Path, job_script: Path) -> None:
    # 480 samples, batch 8, 1 micro-batch per step: 15 steps per epoch on 4 ranks.
    args = ["--dataset-size", "480", "--grad-accum-steps", "1", "--drop-last", "--record-indices"]
    first = tmp_path / "first"
    run_checked(torchrun_argv(4, job_script, ["--run-dir", str(first), "--max-steps", "6", *args]))
    second = tmp_path / "second"
    second.mkdir()
    # The same snapshots, resumed by a 2-rank job that finishes the epoch.
    os.symlink(first / "snapshots", second / "snapshots")
    done = run_checked(
        torchrun_argv(2, job_script, ["--run-dir", str(second), "--max-epochs", "1", *args])
    )
    assert "RESULT resumed_from=6" in done.stdout

    seen = _consumed(first, 4) + _consumed(second, 2)
    counts = Counter(seen)
    assert sorted(counts) == list(range(480)), "some samples were never seen"
    assert max(counts.values()) == 1, f"seen twice: {[i for i, c in counts.items() if c > 1]}"


def test_a_log_steps_line_comes_once_its_loss_is_summed_not_a_log_interval_later(
    tmp_path: Path, job_script: Path
) -> None:
    # The loss of a log step is summed over the ranks in the background; rank 0 printed its
    # line only at the next log step (with log_every 50, step 50's line at step 100). Now it
    # prints it at the first step after the sum is in: step 4's line before step 7 begins.
    args = ["--max-steps", "12", "--log-every", "4", "--snapshot-every", "0", "--say-steps"]
    args += ["--grad-accum-steps", "1", "--step-sleep", "0.05"]
    done = run_checked(torchrun_argv(2, job_script, ["--run-dir", str(tmp_path / "run"), *args]))
    lines = done.stdout.splitlines()
    began = {
        int(m[1]): i for i, line in enumerate(lines) if (m := re.match(r"SAY step (\d+)$", line))
    }
    shown = {
        int(m[1]): i for i, line in enumerate(lines) if (m := re.match(r"step (\d+)/12 ", line))
    }
    assert sorted(shown) == [4, 8, 12], done.stdout
    assert sorted(began) == list(range(1, 13)), done.stdout
    for step in (4, 8):
        assert began[step] < shown[step] < began[step + 3], done.stdout
    # Every step's record is in metrics.jsonl once, in order.
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == list(range(1, 13))
