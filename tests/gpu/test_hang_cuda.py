"""A rank stuck in a CUDA kernel is a hang: herd notices that no rank makes progress, takes
every worker's stacks (the stuck rank waits in torch.cuda.synchronize), and stops the job.

The verdict is read from the job record (the last attempt's outcome and its stacks folder).
"""

from __future__ import annotations

from pathlib import Path

from tests.gpu.conftest import LaunchScript

# Three steps of progress, then a kernel that spins on the GPU for about ten minutes
# (torch.cuda._sleep counts GPU clock cycles) while the CPU waits for it.
SPIN = """
import os, time, torch
from torchherd.progress import beat
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
for step in range(1, 4):
    beat(step)
    print(f"step {step}", flush=True)
    time.sleep(0.5)
torch.cuda._sleep(int(2e12))
torch.cuda.synchronize()
print("the kernel ended: no hang", flush=True)
"""


def test_rank_spinning_in_a_kernel_is_hung_with_stacks(
    launch_script: LaunchScript, gpus: int
) -> None:
    assert gpus > 0, "torch sees no GPU here although nvidia-smi lists some"
    run, job = launch_script(SPIN, "--hang-timeout", "15", "--grace", "3", timeout=240)
    assert job is not None, run.tail()
    assert job.outcome == "hung" and job.state == "failed", (job, run.tail())
    assert "the kernel ended" not in run.stdout
    assert job.stacks_dir, job
    stacks = {path.name: path.read_text() for path in Path(job.stacks_dir).glob("*rank-*.txt")}
    assert len(stacks) == gpus, (sorted(stacks), run.tail())
    assert all("synchronize" in text for text in stacks.values()), stacks
