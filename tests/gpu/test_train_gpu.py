"""torchherd.train on GPUs: examples/gpt.py with FSDP in bf16 on every GPU snapshots and
resumes, with MFU in its metrics where the GPU's peak is known; compiled blocks train; an async
snapshot stages GPU state in pinned host memory and loads back equal."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.gpu.launching import REPO, launch, run
from bench.gpu.machine import TorchFeatures
from torchherd.train.metrics import peak_flops_for

SMALL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "128", "--block-size", "128"]


def _gpt(tmp_path: Path, *args: str) -> list[str]:
    """examples/gpt.py's command line (run from the checkout), small, writing to tmp_path."""
    return ["examples/gpt.py", *SMALL, "--run-dir", str(tmp_path / "run"), *args]


def _metrics(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "step" in r]


def test_gpt_fsdp_bf16_snapshots_and_resumes(
    tmp_path: Path, gpus: int, torch_here: TorchFeatures
) -> None:
    assert gpus > 0, "torch sees no GPU here although nvidia-smi lists some"
    if not torch_here.fsdp2:
        pytest.skip(f"torch {torch_here.version} has no public fully_shard (FSDP2: torch 2.6)")
    common = ["--parallel", "fsdp", "--precision", "bf16", "--snapshot-every", "5"]
    common += ["--log-every", "5", "--eval-every", "5"]
    first, job = launch(
        _gpt(tmp_path, *common, "--max-steps", "10"), home=tmp_path / "home", cwd=REPO
    )
    assert job is not None and job.succeeded and job.world_size == gpus, first.tail()
    second, job = launch(
        _gpt(tmp_path, *common, "--max-steps", "15"), home=tmp_path / "home2", cwd=REPO
    )
    assert job is not None and job.succeeded, second.tail()
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 16))  # resumed at 10, not from 0
    assert sorted(p.name for p in (tmp_path / "run" / "snapshots").glob("step-*")) == [
        "step-10",
        "step-15",
        "step-5",
    ]
    logged = [r for r in records if "tokens_per_s" in r]
    assert logged, records
    peak = peak_flops_for(torch_here.devices[0] if torch_here.devices else "")
    assert all(("mfu" in r) == (peak is not None) for r in logged), (peak, logged)


def test_gpt_compiled_blocks_train(tmp_path: Path, gpus: int, torch_here: TorchFeatures) -> None:
    assert gpus > 0, "torch sees no GPU here although nvidia-smi lists some"
    if torch_here.compile_on_gpu:
        pytest.skip(torch_here.compile_on_gpu)
    args = ["--compile", "true", "--precision", "bf16", "--max-steps", "6", "--log-every", "2"]
    done, job = launch(_gpt(tmp_path, *args), home=tmp_path / "home", cwd=REPO, timeout=400)
    assert job is not None and job.succeeded, done.tail()
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[-1]["loss"] < records[0]["loss"]


STAGING = """
import torch
from torchherd.train import Snapshotter
from torchherd.train._staging import HostStager
from torchherd.train.dist import Context

state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.arange(10, device="cuda")}
stager = HostStager()
staged = stager.stage(state)
assert all(t.device.type == "cpu" and t.is_pinned() for t in staged.values()), staged
assert all(torch.equal(staged[k], state[k].cpu()) for k in state)
again = stager.stage(state)
assert again["w"].data_ptr() == staged["w"].data_ptr(), "the pinned buffers are reused"

ctx = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cuda"))
snaps = Snapshotter(DIRECTORY, ctx=ctx)
before = state["w"].cpu()
assert snaps.save_async(3, state)
state["w"].add_(1)  # training goes on: the snapshot keeps the values of step 3
snaps.wait()
step, loaded = snaps.load_latest()
assert step == 3 and torch.equal(loaded["w"], before), step
print("STAGING OK", flush=True)
"""


def test_async_snapshot_stages_gpu_state_in_pinned_memory(tmp_path: Path, gpus: int) -> None:
    assert gpus > 0, "torch sees no GPU here although nvidia-smi lists some"
    source = STAGING.replace("DIRECTORY", repr(str(tmp_path / "snapshots")))
    done = run([sys.executable, "-c", source], cwd=tmp_path, timeout=180)
    assert done.returncode == 0 and "STAGING OK" in done.stdout, done.tail()
