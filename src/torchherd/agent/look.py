"""A look at the job's ranks on this node, for the launcher's hang watch (never pauses them).

When a job has gone quiet, the launcher asks every agent to look. For each rank a look says:

    state      the kernel's state letter (T: stopped by a signal or a debugger)
    cpu        CPU ticks of the rank's whole process tree so far (DataLoader workers too)
    io         bytes its tree read and wrote so far (None where the kernel does not say)
    frames     the main thread's Python frames, innermost first ("function (file:line)"),
               from ``py-spy dump --nonblocking`` (which reads memory without stopping the
               process); None when they could not be taken, with ``error`` saying why
    active     py-spy's word on whether the main thread was running on a CPU
    gpu        whether the rank has an NVIDIA GPU open
    phase      the known long phase the rank declared (torchherd.progress.phase), if any,
               with ``phase_limit`` (seconds it may last, when the script set it)
    main       the main thread as the kernel sees it: state, wait channel, the system call
               it is blocked in, its context switches so far (agent.workers.thread_wait)
    outside    what the main thread waits on outside the job, in words (a socket read, a
               poll, a file lock, a sleep, disk wait), or None
    disk       how many of the rank's threads are in disk wait (state D)
    loader     only while the main thread waits for a batch from its DataLoader's worker
               processes: each such child as it is (pid, state, what any of its threads
               waits on outside the job, its main thread's frames): the rank is only as
               alive as they are

With the ranks, a look says how torchrun itself (the node's elastic agent) is: its state, the
CPU ticks and I/O of that one process, and its main thread's wait (``torchrun``): before it
has started its workers, it is the only thing on the node to judge.

Counters are cumulative: the launcher judges the difference between two looks (recovery.hang).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import progress
from . import workers as procs
from .stacks import py_spy, run_py_spy

# Seconds one non-blocking dump may take (it reads memory; it never waits for the process).
LOOK_TIMEOUT = 10.0
# Frames kept per rank: enough to see the collective and the user's line that called it.
FRAMES_KEPT = 12
# Where a rank's main thread waits for a batch from its DataLoader's worker processes (the
# multi-process iterator's own methods; recovery.hang judges the frames exactly).
# py-spy names a method with its class: "_MultiProcessingDataLoaderIter._try_get_data (...)".
LOADER_WAIT = re.compile(r"^(\S+\.)?_(try_)?get_data \(\S*torch/utils/data/dataloader\.py:")
# A waiting rank's children looked at (its loader workers), and how many of them get their
# frames taken (a py-spy each): the others are read from the kernel alone, and a poll there
# counts as a wait outside the job, since without frames it cannot be told from a worker's
# wait for its next indices (the watch then errs towards no verdict, never a false one).
LOADER_KEPT = 64
LOADER_FRAMES = 8


def main_frames(dump: list[dict[str, Any]]) -> tuple[list[str], bool | None]:
    """The main thread's frames ("function (file:line)", innermost first) and whether it was
    active, from ``py-spy dump --json`` output."""
    threads = [t for t in dump if isinstance(t, dict)]
    main = next((t for t in threads if t.get("thread_name") == "MainThread"), None)
    if main is None and threads:
        main = threads[0]
    if main is None:
        return [], None
    frames = []
    for frame in main.get("frames") or []:
        name = frame.get("name", "?")
        where = frame.get("short_filename") or frame.get("filename") or "?"
        frames.append(f"{name} ({where}:{frame.get('line', '?')})")
    active = main.get("active")
    return frames[:FRAMES_KEPT], active if isinstance(active, bool) else None


def frames_of(pid: int, tool: str | None) -> dict[str, Any]:
    """One process's main-thread frames without pausing it, or why there are none."""
    text, error = run_py_spy(tool, pid, ["--nonblocking", "--json"], LOOK_TIMEOUT)
    if text is None:
        return {"frames": None, "error": error}
    try:
        frames, active = main_frames(json.loads(text))
    except ValueError:
        return {"frames": None, "error": "py-spy answered with something that is not JSON"}
    return {"frames": frames, "active": active}


def look(
    job_id: str,
    node: str,
    attempt: str | None,
    progress_dir: str | None,
    with_frames: bool = True,
    under: int | None = None,
) -> list[dict[str, Any]]:
    """One observation per rank of the attempt on this node (see the module docstring;
    ``under``: the ranks are among that process's descendants, see find_workers)."""
    found = procs.find_workers(job_id, node, attempt, under=under)
    if not found:
        return []
    declared = progress.read_progress(progress_dir) if progress_dir else {}
    tool = py_spy() if with_frames else None

    def observe(worker: procs.Worker) -> dict[str, Any]:
        seen: dict[str, Any] = {
            "rank": worker.rank,
            "local_rank": worker.local_rank,
            "pid": worker.pid,
            "state": procs.process_state(worker.pid),
            "cpu": procs.cpu_ticks(worker.tree),
            "io": procs.io_bytes(worker.tree),
            "children": len(worker.children),
            "gpu": procs.holds_gpu(worker.pid),
        }
        main = procs.thread_wait(worker.pid)
        seen["main"] = main
        seen["outside"] = procs.waiting_outside(worker.pid, main)
        seen["disk"] = procs.threads_in_disk_wait(worker.pid)
        if with_frames:
            seen |= frames_of(worker.pid, tool)
            if any(LOADER_WAIT.match(frame) for frame in seen.get("frames") or ()):
                seen["loader"] = [
                    look_at_child(child, tool if n < LOADER_FRAMES else None)
                    for n, child in enumerate(worker.children[:LOADER_KEPT])
                ]
        mine = declared.get(worker.rank)
        if mine is not None and mine.phase:
            seen["phase"] = mine.phase
            seen["phase_since"] = mine.phase_since
            if mine.phase_limit is not None:
                seen["phase_limit"] = mine.phase_limit
        return seen

    with ThreadPoolExecutor(max_workers=min(16, len(found))) as pool:
        return list(pool.map(observe, found))


def look_at_child(pid: int, tool: str | None) -> dict[str, Any]:
    """A rank's child (a DataLoader worker) as a rank is looked at: state, what it waits on
    outside the job (any of its threads: agent.workers), its main thread's frames (None
    without ``tool``)."""
    return {
        "pid": pid,
        "state": procs.process_state(pid),
        "outside": procs.any_thread_waiting_outside(pid),
        "frames": frames_of(pid, tool).get("frames") if tool else None,
    }


def look_at_torchrun(pid: int) -> dict[str, Any]:
    """torchrun's own process (not its workers): state, CPU, I/O, its main thread's wait."""
    return {
        "pid": pid,
        "state": procs.process_state(pid),
        "cpu": procs.cpu_ticks([pid]),
        "io": procs.io_bytes([pid]),
        "main": procs.thread_wait(pid),
    }


def look_event(
    job_id: str,
    node: str,
    attempt: str | None,
    progress_dir: str | None,
    torchrun: int | None = None,
    under: int | None = None,
) -> dict[str, Any]:
    """The {"e": "look"} event an agent sends when the launcher asks (``torchrun``: the pid
    of the attempt's torchrun, when it runs; ``under``: the agent's pid)."""
    started = time.time()
    ranks = look(job_id, node, attempt, progress_dir, under=under)
    event: dict[str, Any] = {
        "e": "look",
        "host": node,
        "a": attempt,
        "at": started,
        "ticks": procs.CLOCK_TICKS,
        "ranks": ranks,
    }
    if torchrun is not None:
        event["torchrun"] = look_at_torchrun(torchrun)
    return event
