"""Part 4 of the GPU check: `herd bench allreduce` on this machine's GPUs.

With two GPUs or more: NCCL all-reduce between them, one worker per GPU, as `herd bench
allreduce` runs it; the sums must be exact and the backend NCCL, and the peak bus bandwidth is
reported. With one GPU there is no link between GPUs to measure: that row says so (not run), the
bench still runs on the one rank (NCCL starts, the sums are right: the path works), and the
local copy bandwidth of the GPU is measured instead (bench/gpu/copy_worker.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .launching import herd, python_module
from .report import Row, failed, measured, not_run, passed

PART = "allreduce"
COPY_MARKER = "HERD_GPU_COPY "
BETWEEN_GPUS = "NCCL all-reduce between GPUs"


def mode(gpus: int) -> str:
    """``between`` (two GPUs or more: measure NCCL between them) or ``copy`` (one GPU)."""
    return "between" if gpus >= 2 else "copy"


def bench_rows(result: Mapping[str, Any], gpus: int) -> list[Row]:
    """Rows from `herd bench allreduce --json` on ``gpus`` GPUs."""
    world = int(result.get("world_size", 0))
    backend = str(result.get("backend"))
    name = f"herd bench allreduce, {world} rank(s)"
    problems = []
    if backend != "nccl":
        problems.append(f"backend {backend}, not nccl: the GPUs were not used")
    if world != gpus:
        problems.append(f"{world} rank(s) on {gpus} GPU(s): not one worker per GPU")
    if not result.get("correct"):
        problems.append("wrong sums")
    if problems:
        return [failed(PART, name, "; ".join(problems))]
    rows = [passed(PART, name, f"{backend}, sums exact at every size")]
    peak = max(result.get("rows") or [], key=lambda r: r["busbw_gbytes"], default=None)
    if mode(gpus) == "between" and peak is not None:
        rows.append(
            measured(
                PART,
                f"{BETWEEN_GPUS}, peak bus bandwidth",
                peak["busbw_gbytes"],
                f"{peak['busbw_gbytes']:.1f} GB/s at {peak['size_bytes'] >> 20} MiB "
                f"(algbw {peak['algbw_gbytes']:.1f} GB/s)",
                sizes=result.get("rows"),
            )
        )
    return rows


def copy_rows(answer: Mapping[str, Any]) -> list[Row]:
    size = answer["bytes"] >> 20
    return [
        measured(
            PART,
            "local copy bandwidth, device to device (one GPU)",
            answer["device_to_device_gbytes"],
            f"{answer['device_to_device_gbytes']:.0f} GB/s ({size} MiB copies)",
        ),
        measured(
            PART,
            "local copy bandwidth, pinned host to device",
            answer["host_to_device_gbytes"],
            f"{answer['host_to_device_gbytes']:.1f} GB/s ({size} MiB copies)",
        ),
    ]


def run_allreduce(out_dir: Path, gpus: int) -> list[Row]:
    where = out_dir / "allreduce"
    where.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    if mode(gpus) == "copy":
        rows.append(not_run(PART, BETWEEN_GPUS, "one GPU here: no link between GPUs to measure"))
    done = herd(
        ["bench", "allreduce", "--json", "--max-size", "256M"],
        home=where / "home",
        cwd=where,
        timeout=300,
    )
    try:
        result = json.loads(done.stdout)
    except ValueError:
        rows.append(failed(PART, "herd bench allreduce", f"exit {done.returncode}: {done.tail(4)}"))
    else:
        rows += bench_rows(result, gpus)
    if mode(gpus) == "copy":
        run, answer = python_module("bench.gpu.copy_worker", [], COPY_MARKER, timeout=120)
        if answer is None:
            rows.append(
                failed(PART, "local copy bandwidth", f"exit {run.returncode}: {run.tail(4)}")
            )
        else:
            rows += copy_rows(answer)
    return rows
