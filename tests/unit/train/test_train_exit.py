"""How a training process ends, outside herd: ``train.teardown()`` waits under plain torchrun
(herd's exit guard is not there), and a background save still in flight when a script simply
ends is committed before the interpreter exits."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch
from train_helpers import run_checked, subprocess_env, torchrun_argv

from torchherd import exit_guard
from torchherd.train import Snapshotter
from torchherd.train.dist import Context

_TEARDOWN = """
import os, sys, time
import torch.distributed as dist
from torchherd import exit_guard, train

ctx = train.setup()
dist.all_reduce(__import__("torch").ones(4))
calls = []

def watch(frame, event, arg):
    if frame.f_code.co_name == "let_threads_finish" and event in ("call", "return"):
        calls.append((event, time.monotonic()))

sys.setprofile(watch)
train.teardown()
sys.setprofile(None)
waited = calls[-1][1] - calls[0][1] if len(calls) == 2 else -1.0
print(
    f"RESULT rank={ctx.rank} herd={bool(os.environ.get('HERD_JOB_ID'))} "
    f"guard={exit_guard._installed} left={not dist.is_initialized()} "
    f"calls={[event for event, _ in calls]} waited={waited:.3f}",
    flush=True,
)
"""


def test_teardown_waits_under_plain_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "teardown_job.py"
    script.write_text(_TEARDOWN)
    done = run_checked(torchrun_argv(2, script, []))
    # Two processes share the pipe: find the lines wherever they landed.
    lines = sorted(re.findall(r"RESULT rank=\d [^\n]*?waited=[\d.-]+", done.stdout))
    assert len(lines) == 2, done.stdout
    for rank, line in enumerate(lines):
        fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
        assert fields["rank"] == str(rank) and fields["left"] == "True"
        # Not under herd, so no exit guard: teardown itself gave the threads their moment.
        assert fields["herd"] == "False" and fields["guard"] == "False"
        assert "['call', 'return']" in line, line
        assert float(fields["waited"]) >= exit_guard.DRAIN_SECONDS, line


_ENDS_WHILE_SAVING = """
import sys, torch
from torchherd.train import Snapshotter
from torchherd.train.dist import Context

ctx = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
snaps = Snapshotter(sys.argv[1], ctx=ctx)
snaps.save(1, {"w": torch.ones(8), "name": "small"})
snaps.save_async(2, {"w": torch.ones(96 * 1024 * 1024), "name": "big"})  # 384 MB
print(f"saving={snaps.saving}", flush=True)
# The script ends here: no wait(), no close().
"""


def test_an_async_save_in_flight_is_finished_at_a_normal_exit(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    done = subprocess.run(
        [sys.executable, "-c", _ENDS_WHILE_SAVING, str(root)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "saving=True"  # it was still writing when the script ended
    snaps = Snapshotter(root, ctx=Context(0, 0, 1, torch.device("cpu")))
    step, state = snaps.load_latest()
    assert step == 2 and state["name"] == "big" and snaps.problems == []
