"""Part 3 of the GPU check: snapshots of a GPU state of at least 4 GB.

Runs bench/gpu/snapshot_worker.py on GPU 0 (sync save, async stall, DCP's async_save with its
own buffer reuse, on the same state and disk) and judges: stall <= 0.1 x our sync save, and
our stall below DCP's. Before anything is allocated it checks that the state fits: free disk
where it writes (our snapshot, the one being replaced, DCP's copy), GPU memory, host memory for
the pinned buffers (ours and DCP's); short of any, the part is not run, and says which.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .launching import python_module
from .report import Row, Target, failed, measured, not_run, passed

PART = "snapshot"
MARKER = "HERD_GPU_SNAPSHOT "
STALL_TARGET = Target("<=", 0.1)
VERSUS_DCP_TARGET = Target("<", 1.0)
GB = 1e9


def precheck(
    state_bytes: float, disk_free: float, gpu_memory: float | None, host_available: float | None
) -> str | None:
    """Why a state of ``state_bytes`` cannot be measured here (None: it can)."""
    disk_needed = 3 * state_bytes + 2 * GB  # ours, the one it replaces, DCP's; then slack
    if disk_free < disk_needed:
        return (
            f"only {disk_free / GB:.1f} GB free where it writes, {disk_needed / GB:.0f} GB "
            "needed (give --scratch DIR on a larger disk)"
        )
    if gpu_memory is not None and gpu_memory < 1.2 * state_bytes + 2 * GB:
        return f"GPU 0 has {gpu_memory / GB:.0f} GB, the {state_bytes / GB:.0f} GB state needs more"
    if host_available is not None and host_available < 3 * state_bytes + 4 * GB:
        return (
            f"{host_available / GB:.0f} GB of host memory available; the pinned buffers "
            f"(ours and DCP's) and the load need {(3 * state_bytes + 4 * GB) / GB:.0f} GB"
        )
    return None


def snapshot_rows(answer: Mapping[str, Any]) -> list[Row]:
    """Rows from the worker's answer."""
    size = answer["bytes"] / GB
    sync, stall = answer["sync_median_s"], answer["stall_median_s"]
    what = f"{size:.1f} GB GPU state ({answer['tensors']} tensors)"
    rows = [
        measured(
            PART,
            f"sync save, {what}",
            sync,
            f"Snapshotter.save median {sync:.2f} s ({size / sync:.2f} GB/s)",
            sync_s=answer["sync_s"],
        ),
        measured(
            PART,
            "async stall / sync save",
            stall / sync,
            f"save_async stall median {stall:.3f} s / {sync:.2f} s = {stall / sync:.3f}",
            STALL_TARGET,
            stall_s=answer["stall_s"],
        ),
    ]
    dcp = answer.get("dcp_stall_median_s")
    if dcp:
        rows.append(
            measured(
                PART,
                "our stall / DCP async_save stall",
                stall / dcp,
                f"{stall:.3f} s / {dcp:.3f} s = {stall / dcp:.3f}; DCP's buffer reuse: "
                f"{answer.get('dcp_reuse')}" + _failed_first(answer.get("dcp_fallbacks")),
                VERSUS_DCP_TARGET,
                dcp_stall_s=answer.get("dcp_stall_s"),
            )
        )
    else:
        why = answer.get("dcp_error") or "no DCP measurement"
        rows.append(not_run(PART, "our stall / DCP async_save stall", f"DCP: {why}"))
    if answer.get("round_trip"):
        rows.append(passed(PART, "snapshot of GPU state loads back equal"))
    else:
        rows.append(failed(PART, "snapshot of GPU state loads back equal", "it did not"))
    return rows


def _failed_first(fallbacks: object) -> str:
    """The better buffer reuses that failed on this torch, each with the start of its error."""
    if not isinstance(fallbacks, list) or not fallbacks:
        return ""
    return " (failed first: " + "; ".join(str(f)[:100] for f in fallbacks) + ")"


def _host_available() -> float | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def run_snapshots(
    scratch: Path, gigabytes: float, gpu_memory: float | None, rounds: int = 2
) -> list[Row]:
    scratch.mkdir(parents=True, exist_ok=True)
    why = precheck(gigabytes * GB, shutil.disk_usage(scratch).free, gpu_memory, _host_available())
    if why:
        return [not_run(PART, f"snapshots of a {gigabytes:g} GB GPU state", why)]
    # A folder of our own inside it: only that is removed afterwards.
    mine = Path(tempfile.mkdtemp(prefix="herd-gpu-check-", dir=scratch))
    args = ["--dir", str(mine), "--gigabytes", str(gigabytes), "--rounds", str(rounds)]
    try:
        done, answer = python_module(
            "bench.gpu.snapshot_worker", args, MARKER, timeout=max(300.0, 120 * gigabytes)
        )
    finally:
        shutil.rmtree(mine, ignore_errors=True)
    if answer is None:
        return [failed(PART, "snapshot worker", f"exit {done.returncode}: {done.tail(4)}")]
    return snapshot_rows(answer)
