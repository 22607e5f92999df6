"""Why a rank on this node is slow, as far as the node can tell (stdlib only).

Asked by the launcher once it has named a slow rank, the agent reads the node twice, WINDOW
seconds apart (``gather``), and a pure function judges what it read (``judge``); a wrong cause
is worse than none, so each cause needs its own evidence and nothing is said without it:

    stopped    the rank was stopped (state T) at some of the window's state reads (one every
               STATE_EVERY s): SIGSTOP, a debugger; said with the share of the window, so
               a stop for a fifth of each second (a 1.25x slowdown) is seen, not only a
               stop that lasts
    cgroup     the rank's CPU cgroup throttled it for at least THROTTLED of the window
               (cpu.stat's throttled_usec in cgroup v2, throttled_time in v1), with the quota
    CPU        the rank's busiest thread was runnable but not running (/proc/PID/task/*/
               schedstat's run delay) for at least RUN_DELAY of the window beyond its
               throttling: another process wanted its CPU. The node's processes (those in
               the rank's network namespace) outside the job that used at least BUSY of a
               core on the rank's CPUs meanwhile are named (CPU time counted by the share of
               the rank's CPUs among those the process may use), with the node's CPU
               pressure (PSI); with no such process, twice RUN_DELAY is needed
    pressure   memory or I/O pressure on the node (PSI some avg10 of at least MEMORY_PSI /
               IO_PSI %), said only when no CPU cause shows (a process starved of CPU shows
               pressure everywhere)
    gpu        the GPU clocks are throttled (nvidia-smi's active throttle reasons)

The launcher adds what the rank's own beats show (a data loader it waited for), and says
"unknown" itself when nothing shows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from . import workers as procs

# Seconds between the two reads a cause is judged on.
WINDOW = 2.0
# Seconds between reads of the rank's state within the window: a rank stopped for a fraction
# of every second (SIGSTOP and SIGCONT in turn) is caught by many reads, not by two.
STATE_EVERY = 0.02
# Shares of the window: throttled by the cgroup, runnable but not running; share of a core a
# process outside the job must use to be named as competing.
THROTTLED = 0.02
RUN_DELAY = 0.05
BUSY = 0.08
# PSI "some" avg10 (percent) from which memory or I/O pressure is named.
MEMORY_PSI = 10.0
IO_PSI = 20.0


@dataclass(frozen=True)
class Competitor:
    name: str
    pid: int
    share: float
    """Share of a core it used over the window."""


@dataclass(frozen=True)
class Evidence:
    """What the node showed about one rank over ``window`` seconds."""

    window: float
    stopped: float = 0.0
    """Share of the window's state reads that found the rank stopped (state T)."""
    throttled: float = 0.0
    """Seconds the rank's CPU cgroup was throttled."""
    quota: str | None = None
    run_delay: float = 0.0
    """Seconds the rank's busiest thread was runnable but not running."""
    competitors: tuple[Competitor, ...] = ()
    pressure: dict[str, float] = field(default_factory=dict)
    """PSI "some" avg10 by resource (cpu, memory, io), percent."""
    gpu: str | None = None


def judge(seen: Evidence) -> list[str]:
    """The likely causes the evidence supports (see the module docstring); [] when none."""
    causes = []
    if seen.stopped > 0:
        causes.append(
            f"it was stopped {100 * seen.stopped:.0f}% of the time (state T: SIGSTOP, a debugger)"
        )
    throttled = seen.throttled / seen.window
    if throttled >= THROTTLED:
        limit = f" (quota {seen.quota})" if seen.quota else ""
        causes.append(f"CPU throttled by its cgroup{limit}")
    waited = (seen.run_delay - seen.throttled) / seen.window
    # Without a process to name, a CPU cause needs twice the evidence.
    enough = RUN_DELAY if seen.competitors else 2 * RUN_DELAY
    if waited >= enough and (seen.competitors or throttled < THROTTLED):
        text = f"waiting for a CPU {100 * waited:.0f}% of the time"
        if "cpu" in seen.pressure:
            text += f" (CPU pressure {seen.pressure['cpu']:.0f}%)"
        if seen.competitors:
            text += "; competing for its CPU: " + ", ".join(
                f"{c.name} (pid {c.pid}, {100 * c.share:.0f}% of a core)" for c in seen.competitors
            )
        else:
            text += "; no process on the node stands out"
        causes.append(text)
    if not causes:
        if seen.pressure.get("memory", 0.0) >= MEMORY_PSI:
            causes.append(f"memory pressure on the node ({seen.pressure['memory']:.0f}%)")
        if seen.pressure.get("io", 0.0) >= IO_PSI:
            causes.append(f"I/O pressure on the node ({seen.pressure['io']:.0f}%)")
    if seen.gpu:
        causes.append(seen.gpu)
    return causes


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


def throttled(directory: str) -> float:
    """Seconds the cgroup was throttled so far (v2: throttled_usec; v1: throttled_time, ns)."""
    try:
        with open(os.path.join(directory, "cpu.stat")) as handle:
            stats = dict(line.split() for line in handle if line.strip())
    except (OSError, ValueError):
        return 0.0
    if "throttled_usec" in stats:
        return int(stats["throttled_usec"]) / 1e6
    return int(stats.get("throttled_time") or 0) / 1e9


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


def run_delay(pid: int) -> float:
    """Seconds the process's most delayed thread has waited runnable but not running."""
    most = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                most = max(most, int(handle.read().split()[1]) / 1e9)
        except (OSError, ValueError, IndexError):
            continue
    return most


def pressure() -> dict[str, float]:
    """PSI "some" avg10 per resource (percent), where the kernel keeps it."""
    found = {}
    for resource in ("cpu", "memory", "io"):
        try:
            with open(f"/proc/pressure/{resource}") as handle:
                first = handle.readline().split()
        except OSError:
            continue
        fields = dict(item.split("=", 1) for item in first[1:] if "=" in item)
        if "avg10" in fields:
            found[resource] = float(fields["avg10"])
    return found


def _namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _cpus(pid: int) -> set[int]:
    """The CPUs the process may run on (Cpus_allowed_list)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            line = next(x for x in handle if x.startswith("Cpus_allowed_list:"))
    except (OSError, StopIteration):
        return set()
    found: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            found.update(range(int(low), int(high or low) + 1))
    return found


def _node_processes(near: int) -> list[int]:
    """The processes in ``near``'s network namespace: the node, as its agent sees it."""
    mine = _namespace(near)
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and _namespace(int(entry)) == mine
    ]


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


def gather(
    job_id: str, node: str, attempt: str | None, rank: int, under: int | None = None
) -> Evidence | None:
    """Read the node twice, WINDOW s apart, about ``rank`` (None: no such rank here;
    ``under``: the ranks are among that process's descendants, see find_workers)."""
    workers = procs.find_workers(job_id, node, attempt, under=under)
    found = [w for w in workers if w.rank == rank]
    if not found:
        return None
    worker = found[0]
    job = set(procs.descendants(worker.pid)) | {worker.pid, os.getpid()}
    for other in workers:
        job |= set(other.tree)
        launcher = procs.parent(other.pid)  # torchrun, which waits
        if launcher is not None:
            job.add(launcher)
    groups = cgroup_dirs(worker.pid)
    cpus = _cpus(worker.pid)
    # The share of each process's CPU time spent on the rank's CPUs, were it spread evenly
    # over the CPUs it may use: one pinned to the rank's CPU counts whole.
    overlap = {}
    for pid in _node_processes(worker.pid):
        allowed = _cpus(pid)
        if pid not in job and (not cpus or allowed & cpus):
            overlap[pid] = len(allowed & cpus) / len(allowed) if cpus and allowed else 1.0
    others = list(overlap)
    before_throttle = {d: throttled(d) for d in groups}
    before_delay = run_delay(worker.pid)
    before_cpu = {pid: procs.cpu_ticks([pid]) for pid in others}
    started = time.monotonic()
    reads = stops = 0
    while True:
        reads += 1
        stops += procs.process_state(worker.pid) in ("T", "t")
        if time.monotonic() - started >= WINDOW:
            break
        time.sleep(STATE_EVERY)
    window = time.monotonic() - started
    ticks = procs.CLOCK_TICKS * window
    used = sorted(
        (
            ((procs.cpu_ticks([pid]) - before) * overlap[pid], pid)
            for pid, before in before_cpu.items()
        ),
        reverse=True,
    )
    throttled_for, limit = 0.0, None
    for directory, before in before_throttle.items():
        if throttled(directory) - before > throttled_for:
            throttled_for, limit = throttled(directory) - before, quota(directory)
    return Evidence(
        window=window,
        stopped=stops / reads,
        throttled=throttled_for,
        quota=limit,
        run_delay=run_delay(worker.pid) - before_delay,
        competitors=tuple(
            Competitor(_name(pid), pid, ticks_used / ticks)
            for ticks_used, pid in used[:3]
            if ticks_used >= BUSY * ticks
        ),
        pressure=pressure(),
        gpu=gpu_throttling(),
    )


def likely_causes(
    job_id: str, node: str, attempt: str | None, rank: int, under: int | None = None
) -> list[str]:
    """What this node can tell about why ``rank`` is slow (see the module docstring)."""
    seen = gather(job_id, node, attempt, rank, under=under)
    return [] if seen is None else judge(seen)


def why_slow_event(
    job_id: str, node: str, attempt: str | None, rank: int, under: int | None = None
) -> dict[str, Any]:
    return {
        "e": "why-slow",
        "a": attempt,
        "r": rank,
        "causes": likely_causes(job_id, node, attempt, rank, under=under),
    }
