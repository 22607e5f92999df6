"""A worker that fails on the GPU: the job's first failure names the rank and gives the cause
and the fix in words. Read from the job record, which the closing summary prints; the
console's wording is for people and may change."""

from __future__ import annotations

from tests.gpu.conftest import LaunchScript
from torchherd.recovery.causes import SIGNATURES

CAUSES = {signature.kind: signature for signature in SIGNATURES}

ORDINAL = """
import torch
torch.zeros(1, device=f"cuda:{torch.cuda.device_count()}")  # one past the last GPU
"""

OUT_OF_MEMORY = """
import os, torch
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
total = torch.cuda.get_device_properties(device).total_memory
torch.empty(2 * total, dtype=torch.uint8, device=device)  # twice what the GPU has
"""

DEVICE_ASSERT = """
import os, torch
device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
table = torch.zeros(4, device=device)
index = torch.tensor([1000], device=device)
print(table[index].sum().item())  # an out-of-range gather: a device-side assert
"""


def _assert_explained(launch_script: LaunchScript, source: str, kind: str) -> None:
    run, job = launch_script(source, "--nproc", "1")
    assert job is not None and job.state == "failed" and job.outcome == "failed", run.tail()
    failure = job.failure
    assert failure.get("host") == "localhost" and failure.get("rank") == 0, failure
    assert failure.get("cause") == CAUSES[kind].cause, failure
    assert failure.get("remedy") == CAUSES[kind].fix, failure


def test_invalid_device_ordinal_is_explained(launch_script: LaunchScript, gpus: int) -> None:
    assert gpus > 0, "torch sees no GPU here although nvidia-smi lists some"
    _assert_explained(launch_script, ORDINAL, "device-ordinal")


def test_cuda_out_of_memory_is_explained(launch_script: LaunchScript, gpus: int) -> None:
    assert gpus > 0, "torch sees no GPU here although nvidia-smi lists some"
    _assert_explained(launch_script, OUT_OF_MEMORY, "cuda-oom")


def test_device_side_assert_is_explained(launch_script: LaunchScript, gpus: int) -> None:
    assert gpus > 0, "torch sees no GPU here although nvidia-smi lists some"
    _assert_explained(launch_script, DEVICE_ASSERT, "cuda-kernel")
