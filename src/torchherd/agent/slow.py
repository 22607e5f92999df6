"""Why a rank on this node is slow, as far as the node can tell (stdlib only).

Asked by the launcher once it has named a slow rank, the agent looks for the usual causes over
a second or two, and says what it found (nothing, when it finds nothing):

    cgroup     the rank's CPU cgroup throttled it meanwhile (a CPU quota: cpu.max in cgroup
               v2, cpu.cfs_quota_us in v1), with the quota
    stopped    the rank was stopped (state T) at one of the looks: SIGSTOP, a debugger
    busy node  the node's run queue is longer than its cores, and the processes that are
               not the job's that used the most CPU meanwhile
    gpu        the GPU clocks are throttled (nvidia-smi's active throttle reasons)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Any

from . import workers as procs

# Seconds between the two looks a cause is judged on.
WINDOW = 1.5
# Share of a core a process not of the job must use to be named.
BUSY = 0.3


def cgroup_dirs(pid: int) -> list[str]:
    """The cgroup directories holding the process's CPU controls (v2 and v1)."""
    found = []
    try:
        with open(f"/proc/{pid}/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found.append(os.path.join("/sys/fs/cgroup", path.lstrip("/")))
            found.append(os.path.join("/sys/fs/cgroup/unified", path.lstrip("/")))
        elif "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                found.append(os.path.join("/sys/fs/cgroup", mount, path.lstrip("/")))
    return [d for d in found if os.path.isfile(os.path.join(d, "cpu.stat"))]


def throttled(directory: str) -> int:
    """Times (v1: periods; v2: microseconds) the cgroup was throttled so far."""
    try:
        with open(os.path.join(directory, "cpu.stat")) as handle:
            stats = dict(line.split() for line in handle if line.strip())
    except (OSError, ValueError):
        return 0
    return int(stats.get("throttled_usec") or stats.get("nr_throttled") or 0)


def quota(directory: str) -> str | None:
    """The cgroup's CPU quota in words ("25% of a CPU"), if it has one."""
    try:
        with open(os.path.join(directory, "cpu.max")) as handle:
            limit, period = handle.read().split()
    except (OSError, ValueError):
        try:
            with open(os.path.join(directory, "cpu.cfs_quota_us")) as handle:
                limit = handle.read().strip()
            with open(os.path.join(directory, "cpu.cfs_period_us")) as handle:
                period = handle.read().strip()
        except OSError:
            return None
    if limit in ("max", "-1"):
        return None
    return f"{100 * int(limit) / int(period):.0f}% of a CPU"


def _cpu_of_all() -> dict[int, int]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found[int(entry)] = procs.cpu_ticks([int(entry)])
    return found


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def gpu_throttling() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=index,clocks_throttle_reasons.active",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    busy = [
        line.split(",")[0].strip()
        for line in out.splitlines()
        if "," in line and line.split(",")[1].strip() not in ("0x0000000000000000", "[N/A]")
    ]
    return f"GPU clocks throttled on GPU {', '.join(busy)} (nvidia-smi)" if busy else None


def likely_causes(job_id: str, node: str, attempt: str | None, rank: int) -> list[str]:
    """What this node can tell about why ``rank`` is slow (see the module docstring)."""
    found = [w for w in procs.find_workers(job_id, node, attempt) if w.rank == rank]
    if not found:
        return []
    worker = found[0]
    job = set(procs.descendants(worker.pid)) | {worker.pid}
    for other in procs.find_workers(job_id, node, attempt):
        job |= set(other.tree)
    groups = cgroup_dirs(worker.pid)
    before_throttle = {d: throttled(d) for d in groups}
    before_cpu = _cpu_of_all()
    states = {procs.process_state(worker.pid)}
    time.sleep(WINDOW)
    states.add(procs.process_state(worker.pid))
    after_cpu = _cpu_of_all()
    causes = []
    for directory, before in before_throttle.items():
        if throttled(directory) > before:
            limit = quota(directory)
            causes.append(f"CPU throttled by its cgroup{f' (quota {limit})' if limit else ''}")
            break
    if states & {"T", "t"}:
        causes.append("it was stopped (state T: SIGSTOP, a debugger)")
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]
    hungry = sorted(
        (
            (after_cpu[pid] - before_cpu.get(pid, after_cpu[pid]), pid)
            for pid in after_cpu
            if pid not in job and pid != os.getpid()
        ),
        reverse=True,
    )
    ticks = procs.CLOCK_TICKS * WINDOW
    others = [f"{_name(pid)} (pid {pid})" for used, pid in hungry[:3] if used >= BUSY * ticks]
    if others and load > cores:
        causes.append(
            f"the node is busy: load {load:.1f} on {cores} core(s); using CPU besides the job: "
            + ", ".join(others)
        )
    gpu = gpu_throttling()
    if gpu:
        causes.append(gpu)
    return causes


def why_slow_event(job_id: str, node: str, attempt: str | None, rank: int) -> dict[str, Any]:
    return {
        "e": "why-slow",
        "a": attempt,
        "r": rank,
        "causes": likely_causes(job_id, node, attempt, rank),
    }
