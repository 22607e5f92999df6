"""The Python stacks of a job's workers on this node, taken with py-spy (evidence before a kill).

Workers are the rank processes torchrun started (agent.workers: found by job id and attempt,
never by name). Each is dumped by ``py-spy dump`` in parallel; a stopped process (state T:
SIGSTOP, a debugger) is read without pausing it (``--nonblocking``), since py-spy cannot suspend
what is already stopped. A rank's children (DataLoader or compile workers) are dumped too, each
under its own pid, never in place of the rank's own stacks. What cannot be dumped is reported
with the reason, never silently dropped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import workers as procs

# Seconds one py-spy dump may take; stacks of every worker come back well within herd's 30 s.
DUMP_TIMEOUT = 15.0
# Children of one rank whose stacks are kept (a DataLoader may have dozens of workers).
CHILDREN_KEPT = 4
PTRACE_HINT = (
    " (ptrace is restricted here: allow it with `sysctl kernel.yama.ptrace_scope=0` "
    "or give herd's agent CAP_SYS_PTRACE)"
)


def py_spy() -> str | None:
    """The py-spy next to this interpreter (a venv's bin), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


# Kept for callers that read a state without the rest of agent.workers.
process_state = procs.process_state


def run_py_spy(
    tool: str | None, pid: int, options: list[str], timeout: float
) -> tuple[str | None, str | None]:
    """``py-spy dump OPTIONS --pid PID``: (its output, None), or (None, why there is none)."""
    if tool is None:
        return None, "py-spy is not installed on this node"
    argv = [tool, "dump", *options, "--pid", str(pid)]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return None, f"py-spy took longer than {timeout:g} s"
    except OSError as exc:
        return None, f"cannot run py-spy: {exc}"
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[0]
        if "ermission" in done.stderr or "ptrace" in done.stderr.lower():
            reason += PTRACE_HINT
        return None, reason
    return done.stdout, None


def dump(pid: int, tool: str | None) -> dict[str, Any]:
    """One process's stacks (text) and state, or the reason there are none."""
    state = procs.process_state(pid)
    # A stopped process cannot be paused by py-spy: it is read as it is.
    options = ["--nonblocking"] if state in ("T", "t") else []
    text, error = run_py_spy(tool, pid, options, DUMP_TIMEOUT)
    return {"state": state, "error": error} if text is None else {"state": state, "stack": text}


def collect(
    job_id: str, node: str, attempt: str | None = None, *, under: int | None = None
) -> list[dict[str, Any]]:
    """Every rank of the job (of ``attempt``) on this node with its stacks, dumped in parallel;
    each rank's first children under ``children`` (pid, state, stack or error). ``under``: the
    ranks are among that process's descendants (see find_workers)."""
    found = procs.find_workers(job_id, node, attempt, under=under)
    if not found:
        return []
    tool = py_spy()
    targets = [(w, pid) for w in found for pid in (w.pid, *w.children[:CHILDREN_KEPT])]
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        dumps = list(pool.map(lambda t: dump(t[1], tool), targets))
    by_pid = {pid: result for (_, pid), result in zip(targets, dumps, strict=True)}
    return [
        {"pid": w.pid, "rank": w.rank, "local_rank": w.local_rank}
        | by_pid[w.pid]
        | {"children": [{"pid": c} | by_pid[c] for c in w.children[:CHILDREN_KEPT]]}
        for w in found
    ]
