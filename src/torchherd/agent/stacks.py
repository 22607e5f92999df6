"""The Python stacks of a job's workers on this node, taken with py-spy (evidence before a kill).

Workers are the job's processes (found by job id, never by name) that torchrun gave a RANK.
Each is dumped by ``py-spy dump`` in parallel; a stopped process (state T: SIGSTOP, a debugger)
is read without pausing it (``--nonblocking``), since py-spy cannot suspend what is already
stopped. What cannot be dumped is reported with the reason, never silently dropped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import processes

# Seconds one py-spy dump may take; stacks of every worker come back well within herd's 30 s.
DUMP_TIMEOUT = 15.0


def py_spy() -> str | None:
    """The py-spy next to this interpreter (a venv's bin), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            raw = handle.read().split(b"\0")
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw if b"=" in item)
    return {key: value for key, _, value in pairs}


def process_state(pid: int) -> str:
    """The kernel's one-letter state: R running, S sleeping, D disk wait, T stopped, Z zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return "?"


def workers(job_id: str, node: str) -> list[dict[str, Any]]:
    """The job's worker processes here: pid, global and local rank."""
    found = []
    for pid in processes.job_processes(job_id, node):
        env = _environ(pid)
        if "RANK" in env and "LOCAL_RANK" in env:
            try:
                found.append(
                    {"pid": pid, "rank": int(env["RANK"]), "local_rank": int(env["LOCAL_RANK"])}
                )
            except ValueError:
                continue
    return sorted(found, key=lambda w: w["rank"])


def dump(pid: int, tool: str | None) -> dict[str, Any]:
    """One process's stacks (text) and state, or the reason there are none."""
    state = process_state(pid)
    if tool is None:
        return {"state": state, "error": "py-spy is not installed on this node"}
    argv = [tool, "dump", "--pid", str(pid)]
    if state == "T":
        argv.append("--nonblocking")
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=DUMP_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return {"state": state, "error": f"py-spy took longer than {DUMP_TIMEOUT:g} s"}
    except OSError as exc:
        return {"state": state, "error": f"cannot run py-spy: {exc}"}
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[0]
        if "ermission" in done.stderr or "ptrace" in done.stderr.lower():
            reason += (
                " (ptrace is restricted here: allow it with `sysctl kernel.yama.ptrace_scope=0` "
                "or give herd's agent CAP_SYS_PTRACE)"
            )
        return {"state": state, "error": reason}
    return {"state": state, "stack": done.stdout}


def collect(job_id: str, node: str) -> list[dict[str, Any]]:
    """Every worker of the job on this node with its stacks, dumped in parallel."""
    found = workers(job_id, node)
    if not found:
        return []
    tool = py_spy()
    with ThreadPoolExecutor(max_workers=min(16, len(found))) as pool:
        dumps = list(pool.map(lambda w: dump(w["pid"], tool), found))
    return [worker | result for worker, result in zip(found, dumps, strict=True)]
