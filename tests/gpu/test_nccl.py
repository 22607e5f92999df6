"""NCCL/CUDA paths: `herd launch` on this machine's GPUs with NCCL. Skipped (with the reason)
where there is no CUDA GPU; run these on a GPU machine: `python -m pytest tests/gpu`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]

SCRIPT = """
import os, torch, torch.distributed as dist
dist.init_process_group("nccl")
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
value = torch.full((1 << 20,), float(dist.get_rank() + 1), device="cuda")
dist.all_reduce(value)
print(f"NCCL rank={dist.get_rank()} world={dist.get_world_size()} sum={value[0].item():.0f} "
      f"device={torch.cuda.current_device()} nccl={torch.cuda.nccl.version()}", flush=True)
dist.destroy_process_group()
"""


def test_nccl_allreduce_one_worker_per_gpu(tmp_path: Path) -> None:
    gpus = torch.cuda.device_count()
    (tmp_path / "nccl_allreduce.py").write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, "-m", "torchherd", "launch", "nccl_allreduce.py"],
        cwd=tmp_path,
        env=dict(os.environ, HERD_HOME=str(tmp_path / "home")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    found = re.findall(r"NCCL rank=(\d+) world=(\d+) sum=(\d+) device=(\d+)", run.stdout)
    assert len(found) == gpus  # one worker per GPU by default
    expected = gpus * (gpus + 1) // 2
    assert all(int(world) == gpus and int(total) == expected for _, world, total, _ in found)
    assert sorted(int(device) for *_, device in found) == list(range(gpus))
