"""What herd sets for GPU workers reaches them: the NCCL flight recorder, its dump on a
timeout into the job's node directory, asynchronous error handling; a user's own value wins;
and with two GPUs, a collective that times out leaves a flight-recorder dump there."""

from __future__ import annotations

import json
from pathlib import Path

from tests.gpu.conftest import LaunchScript

NAMES = (
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "ACCELERATE_USE_CPU",
    "LOCAL_RANK",
)

PRINT_ENV = f"""
import json, os
print("ENV " + json.dumps({{name: os.environ.get(name) for name in {NAMES!r}}}), flush=True)
"""


def _envs(stdout: str) -> list[dict[str, str | None]]:
    return [json.loads(line.split("ENV ", 1)[1]) for line in stdout.splitlines() if "ENV {" in line]


def test_flight_recorder_and_async_errors_reach_every_worker(
    launch_script: LaunchScript, tmp_path: Path, gpus: int
) -> None:
    assert gpus > 0, "torch sees no GPU here although nvidia-smi lists some"
    run, job = launch_script(PRINT_ENV)
    assert job is not None and job.succeeded, run.tail()
    seen = _envs(run.stdout)
    assert sorted(int(env["LOCAL_RANK"] or -1) for env in seen) == list(range(gpus))
    nodes = str(tmp_path / "home" / "nodes")
    for env in seen:
        assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
        assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
        assert (env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] or "").startswith(nodes), env
        assert env["ACCELERATE_USE_CPU"] is None  # a GPU node runs Accelerate on its GPUs

    run, job = launch_script(PRINT_ENV, env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "64"})
    assert job is not None and job.succeeded, run.tail()
    assert {env["TORCH_NCCL_TRACE_BUFFER_SIZE"] for env in _envs(run.stdout)} == {"64"}


# Rank 1 never joins the second all-reduce: rank 0's times out after 20 s, the flight recorder
# dumps its trace, and asynchronous error handling ends the rank.
TIMEOUT = """
import datetime, os, time, torch, torch.distributed as dist
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=20))
value = torch.ones(1024, device="cuda")
dist.all_reduce(value)
torch.cuda.synchronize()
print(f"rank {dist.get_rank()} joined the first all-reduce", flush=True)
if dist.get_rank() == 1:
    time.sleep(600)
dist.all_reduce(value)
torch.cuda.synchronize()
"""


def test_collective_timeout_leaves_a_flight_recorder_dump(
    launch_script: LaunchScript, tmp_path: Path, two_gpus: int
) -> None:
    run, job = launch_script(
        TIMEOUT, "--nproc", "2", "--hang-timeout", "0", "--grace", "3", timeout=240
    )
    assert job is not None and not job.succeeded, run.tail()
    assert job.failure.get("rank") == 0, job
    dumps = list((tmp_path / "home" / "nodes").rglob("nccl-trace-rank-*"))
    assert any(path.name.endswith("rank-0") and path.stat().st_size > 0 for path in dumps), dumps
