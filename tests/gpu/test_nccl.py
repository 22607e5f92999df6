"""NCCL through `herd launch` on this machine's GPUs: one worker per GPU by default, and an
all-reduce whose sum every rank checks. Run on a GPU machine: `python -m pytest tests/gpu`."""

from __future__ import annotations

import re

from tests.gpu.conftest import LaunchScript

SCRIPT = """
import os, torch, torch.distributed as dist
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl")
value = torch.full((1 << 20,), float(dist.get_rank() + 1), device="cuda")
dist.all_reduce(value)
print(f"NCCL rank={dist.get_rank()} world={dist.get_world_size()} sum={value[0].item():.0f} "
      f"device={torch.cuda.current_device()} backend={dist.get_backend()}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_nccl_allreduce_one_worker_per_gpu(launch_script: LaunchScript, gpus: int) -> None:
    assert gpus > 0, "torch sees no GPU here although nvidia-smi lists some"
    run, job = launch_script(SCRIPT)
    assert job is not None and job.succeeded, run.tail()
    assert job.world_size == gpus  # one worker per GPU by default
    found = re.findall(
        r"NCCL rank=(\d+) world=(\d+) sum=(\d+) device=(\d+) backend=(\w+)", run.stdout
    )
    assert len(found) == gpus, run.stdout
    expected = gpus * (gpus + 1) // 2
    assert all(int(world) == gpus and int(total) == expected for _, world, total, *_ in found)
    assert sorted(int(device) for *_, device, _ in found) == list(range(gpus))
    assert {backend for *_, backend in found} == {"nccl"}
