"""`herd doctor` on a GPU machine: its GPU checks pass, its probe's facts (GPU count, names,
memory, driver, CUDA, NCCL) agree with nvidia-smi read independently, and its all-reduce runs
on NCCL with one rank per GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.gpu.launching import herd
from bench.gpu.machine import TorchFeatures
from bench.gpu.smi import SmiReport, compare_with_probe


def test_doctor_gpu_facts_agree_with_nvidia_smi(
    tmp_path: Path, smi: SmiReport, torch_here: TorchFeatures, gpus: int
) -> None:
    assert gpus > 0, "torch sees no GPU here although nvidia-smi lists some"
    run = herd(
        ["doctor", "--json", "--fresh", "--collective"],
        home=tmp_path / "home",
        cwd=tmp_path,
        env={"XDG_CACHE_HOME": str(tmp_path / "cache")},  # the probe's torch cache, fresh
    )
    assert run.returncode == 0, run.tail()
    report = json.loads(run.stdout)
    results = {r["check"]: r for r in report["results"] if r["host"] in (None, "localhost")}

    assert results["torch"]["status"] == "pass", results["torch"]
    assert f"GPUs: {gpus}" in results["torch"]["summary"]
    assert f"CUDA {torch_here.cuda}" in results["torch"]["summary"]
    assert results["workers"]["status"] == "pass", results["workers"]
    assert results["workers"]["data"] == {"nproc": gpus, "gpus": gpus}
    # Idle GPUs pass; another job on them is a warning, never a failure.
    assert results["gpus"]["status"] in ("pass", "warn"), results["gpus"]
    collective = results["collective"]
    assert collective["status"] == "pass", collective
    assert collective["data"] == {"backend": "nccl", "world_size": gpus}

    facts = report["facts"]["localhost"]
    comparison = compare_with_probe(facts, smi, os.environ.get("CUDA_VISIBLE_DEVICES"))
    assert comparison.differ == [], comparison
    assert facts["torch"]["nccl"] == torch_here.nccl
    assert facts["torch"]["version"] == torch_here.version
