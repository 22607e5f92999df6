"""A plain DDP loop's waits, read from DDP's own timings (torchherd.ddp_timing) with no change
to the script: two real ranks under the real torchrun, with herd's worker site on their path
as herd's node wrapper puts it, rank 1 sleeping 40 ms of every iteration outside DDP. The
rank the other waits for waits least: in the beat files rank 0 waits about those 40 ms an
iteration more than rank 1, and both cycle at the slow rank's pace."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchherd import progress
from torchherd.ddp_timing import iteration_timing
from torchherd.exit_guard import for_workers

PLAIN_DDP = """
import time, torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DistributedDataParallel(nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)]))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
batch = torch.randn(64, 256)
for step in range(150):
    if rank == 1:
        time.sleep(0.04)  # a slow data source, a throttled CPU: wherever, outside DDP
    loss = model(batch).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
"""


def test_a_plain_ddp_loop_beats_its_waits_and_the_slow_rank_waits_least(tmp_path: Path) -> None:
    script = tmp_path / "plain_ddp.py"
    script.write_text(PLAIN_DDP)
    beats = tmp_path / "progress"
    beats.mkdir()
    env = dict(os.environ, HERD_PROGRESS_DIR=str(beats), OMP_NUM_THREADS="1")
    for_workers(env)  # herd's worker site first on the workers' path, as on a node
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", "29641", str(script)]
    done = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = progress.read_progress(str(beats))
    fast, slow = seen[0], seen[1]
    assert fast.wait is not None and slow.wait is not None, (fast, slow)
    assert fast.wait - slow.wait > 0.02, (fast.wait, slow.wait)
    assert fast.cycle is not None and slow.cycle is not None
    assert fast.cycle > 0.04 and slow.cycle > 0.04, (fast.cycle, slow.cycle)
    assert fast.step is None  # the script's steps are its own to say


def test_the_wait_is_the_all_reduce_after_the_backward_and_the_cycle_is_per_iteration() -> None:
    data = {"iteration": 30, "backward_comm_time": 44_000_000}
    data["backward_compute_comm_overlap_time"] = 6_000_000
    wait, cycle = iteration_timing(data, 28, 0.3) or (0.0, 0.0)
    assert round(wait, 3) == 0.038 and round(cycle, 3) == 0.15
    assert iteration_timing(data, None, 0.3) is None  # the first read: nothing to compare
    assert iteration_timing(data, 30, 0.3) is None  # no new iteration timed
    assert iteration_timing({"iteration": 31}, 30, 0.3) is None  # not timed by DDP


def test_a_script_that_times_its_own_steps_keeps_ddps_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(progress.PROGRESS_DIR_VAR, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(progress, "_script_times", False)
    monkeypatch.setattr(progress, "_timing_sums", {})
    monkeypatch.setattr(progress, "_last_beat", 0.0)
    monkeypatch.setattr(progress, "_first_beat_marked", True)
    progress.ddp_timed(0.5, 1.0)
    assert progress.read_progress(str(tmp_path))[0].wait == 0.5
    progress.beat(3, wait=0.01, cycle=0.2, now=True)  # the Trainer's own
    progress.ddp_timed(0.5, 1.0)
    monkeypatch.setattr(progress, "_last_beat", 0.0)
    progress.beat(4, now=True)
    assert progress.read_progress(str(tmp_path))[0].wait is None  # DDP's 0.5 s not taken
