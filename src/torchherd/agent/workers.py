"""A job's worker processes on this node, and what the kernel says about them (stdlib only).

Workers are the processes torchrun started for the ranks: tagged with the job (and attempt),
holding RANK and LOCAL_RANK, and whose parent is not itself that rank (torchrun's own process
has no RANK). A rank's children (DataLoader workers, compile workers) inherit its RANK, so they
are told apart by their parent: they belong to the rank's process tree, are counted in its CPU
and I/O, and their stacks are kept apart by pid, never in the rank's own file.

What the kernel says without touching the process: its state (R running, S sleeping, D disk
wait, T stopped, Z zombie), the CPU time of its whole tree (utime + stime, in clock ticks) and
the bytes its tree read and wrote (``rchar + wchar``: files, pipes and sockets alike).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import processes

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Worker:
    """One rank's process on this node, and its descendants."""

    pid: int
    rank: int
    local_rank: int
    children: tuple[int, ...] = field(default=())

    @property
    def tree(self) -> tuple[int, ...]:
        return (self.pid, *self.children)


def environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            raw = handle.read().split(b"\0")
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw if b"=" in item)
    return {key: value for key, _, value in pairs}


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[-1].split()
    except (OSError, IndexError):
        return None


def parent(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def process_state(pid: int) -> str:
    """The kernel's one-letter state: R running, S sleeping, D disk wait, T stopped, Z zombie;
    "?" for a process that is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else "?"


def cpu_ticks(pids: tuple[int, ...] | list[int]) -> int:
    """CPU time (user + system, clock ticks) of these processes together."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:
            total += int(fields[11]) + int(fields[12])
    return total


def io_bytes(pids: tuple[int, ...] | list[int]) -> int | None:
    """Bytes these processes read and wrote through system calls (files, pipes, sockets);
    None when the kernel does not say (another user's process)."""
    total, known = 0, False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/io") as handle:
                for line in handle:
                    name, _, value = line.partition(":")
                    if name in ("rchar", "wchar"):
                        total += int(value)
            known = True
        except (OSError, ValueError):
            continue
    return total if known else None


def holds_gpu(pid: int) -> bool:
    """Whether the process has an NVIDIA GPU open (/dev/nvidiaN among its descriptors)."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia") and target[11:].isdigit():
            return True
    return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...)."""
    found: list[int] = []
    stack = [pid]
    while stack:
        for child in processes.children(stack.pop()):
            found.append(child)
            stack.append(child)
    return found


def find_workers(job_id: str, node: str, attempt: str | None = None) -> list[Worker]:
    """The job's rank processes here (of ``attempt``, when given), each with its descendants."""
    tagged = processes.job_processes(job_id, node, attempt)
    ranks: dict[int, tuple[str, str]] = {}
    for pid in tagged:
        env = environ(pid)
        if "RANK" in env and "LOCAL_RANK" in env:
            ranks[pid] = (env["RANK"], env["LOCAL_RANK"])
    found = []
    for pid, (rank, local_rank) in ranks.items():
        up = parent(pid)
        if up in ranks and ranks[up][0] == rank:
            continue  # a child of the rank (a DataLoader worker): part of the rank's tree
        try:
            found.append(Worker(pid, int(rank), int(local_rank), tuple(descendants(pid))))
        except ValueError:
            continue
    return sorted(found, key=lambda w: w.rank)
