"""Background snapshots on real files: the copy is taken at once, the write goes on behind,
one save at a time, failures surface, and SIGTERM or SIGKILL mid-save never lose the last one."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import subprocess_env

from torchherd.train import SnapshotError, Snapshotter
from torchherd.train._staging import HostStager
from torchherd.train.dist import Context


def ctx(rank: int = 0) -> Context:
    return Context(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"))


def test_state_changed_after_the_call_is_not_what_gets_saved(tmp_path: Path) -> None:
    snaps = Snapshotter(tmp_path / "snaps", ctx=ctx())
    weight = torch.zeros(1024, 1024)
    saved_at: list[object] = []
    assert snaps.save_async(1, {"w": weight, "step": 1}, on_saved=saved_at.append)
    weight.add_(1.0)  # what an optimizer step does right after the save call returns
    snaps.wait()
    assert saved_at == [tmp_path / "snaps" / "step-1"]
    step, state = snaps.load_latest()
    assert step == 1 and torch.equal(state["w"], torch.zeros(1024, 1024))
    snaps.close()


def test_one_save_in_flight_and_pruning_keeps_the_newest(tmp_path: Path) -> None:
    snaps = Snapshotter(tmp_path / "snaps", keep=2, ctx=ctx())
    for step in range(1, 6):
        snaps.save_async(step, {"w": torch.full((256, 256), float(step))})
        assert snaps.saving or snaps.steps()[0] == step
    snaps.close()
    assert snaps.steps() == [5, 4]
    assert not snaps.saving
    step, state = snaps.load_latest()
    assert step == 5 and float(state["w"][0, 0]) == 5.0


def test_other_ranks_do_not_copy_or_write(tmp_path: Path) -> None:
    snaps = Snapshotter(tmp_path / "snaps", ctx=ctx(rank=1))
    assert snaps.save_async(1, {"w": torch.ones(4)}) is False
    snaps.close()
    assert not (tmp_path / "snaps").exists()


def test_a_failed_background_write_is_raised_and_the_previous_snapshot_stays(
    tmp_path: Path,
) -> None:
    snaps = Snapshotter(tmp_path / "snaps", ctx=ctx())
    snaps.save(1, {"w": torch.ones(4)})
    # An object torch.save cannot pickle fails on the background thread, not here.
    assert snaps.save_async(2, {"w": torch.ones(4), "bad": lambda: None})
    with pytest.raises(SnapshotError, match="background snapshot save .* failed"):
        snaps.wait()
    snaps.wait()  # reported once
    assert snaps.latest_step() == 1
    step, _ = snaps.load_latest()
    assert step == 1


def test_staged_copy_reuses_buffers_and_keeps_ties() -> None:
    stager = HostStager()
    shared = torch.arange(6.0)
    first = stager.stage({"a": shared, "b": shared, "n": [1, (2, "x")]})
    assert first["a"] is first["b"] and first["n"] == [1, (2, "x")]
    buffer = first["a"]
    second = stager.stage({"a": shared + 1, "b": shared, "n": []})
    assert second["a"] is buffer  # same shape: the host buffer is reused
    assert torch.equal(second["a"], shared + 1) and torch.equal(second["b"], shared)


_ASYNC_SAVER = """
import sys, torch
from torchherd.train import Snapshotter
from torchherd.train.dist import Context
ctx = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
snaps = Snapshotter(sys.argv[1], ctx=ctx)
snaps.save(1, {"w": torch.ones(8), "name": "small"})
snaps.save_async(2, {"w": torch.ones(96 * 1024 * 1024), "name": "big"})  # 384 MB
print("copied", flush=True)
import time
while True:
    time.sleep(0.01)  # training would go on here
"""


def _start_async_saver(root: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _ASYNC_SAVER, str(root)],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "copied"
    deadline = time.monotonic() + 60
    while not (root / f".tmp-step-2-{proc.pid}" / "state.pt").exists():
        assert time.monotonic() < deadline, "the background save never started writing"
        time.sleep(0.002)
    return proc


def _signal_mid_save(root: Path, signum: signal.Signals) -> tuple[int, Snapshotter]:
    """Send ``signum`` while a background save writes; the exit status and a fresh reader."""
    proc = _start_async_saver(root)
    try:
        proc.send_signal(signum)
    finally:
        proc.wait(timeout=120)
    return proc.returncode, Snapshotter(root, ctx=Context(0, 0, 1, torch.device("cpu")))


def test_sigterm_mid_save_finishes_the_save_then_exits(tmp_path: Path) -> None:
    code, snaps = _signal_mid_save(tmp_path / "snaps", signal.SIGTERM)
    assert code == -signal.SIGTERM  # the signal still ends the process
    step, state = snaps.load_latest()
    assert step == 2 and state["name"] == "big" and snaps.problems == []


def test_sigkill_mid_async_save_leaves_the_previous_snapshot(tmp_path: Path) -> None:
    code, snaps = _signal_mid_save(tmp_path / "snaps", signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert not (tmp_path / "snaps" / "step-2").exists()
    step, state = snaps.load_latest()
    assert step == 1 and state["name"] == "small"


def test_a_background_save_has_pruned_when_it_is_waited_for(tmp_path: Path) -> None:
    # Pruning runs inside the background save, so a deletion never competes with the next
    # save's copy to host memory; waiting for the save means waiting for its pruning too.
    snaps = Snapshotter(tmp_path / "snaps", keep=1, ctx=ctx())
    for step in (1, 2, 3):
        snaps.save_async(step, {"w": torch.full((512, 512), float(step))})
        snaps.wait()
        assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == ["latest", f"step-{step}"]
    snaps.close()
