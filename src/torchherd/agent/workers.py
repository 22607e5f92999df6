"""A job's worker processes on this node, and what the kernel says about them (stdlib only).

Workers are the processes torchrun started for the ranks: tagged with the job (and attempt),
holding RANK and LOCAL_RANK, and whose parent is not itself that rank (torchrun's own process
has no RANK). A rank's children (DataLoader workers, compile workers) inherit its RANK, so they
are told apart by their parent: they belong to the rank's process tree, are counted in its CPU
and I/O, and their stacks are kept apart by pid, never in the rank's own file.

What the kernel says without touching the process: its state (R running, S sleeping, D disk
wait, T stopped, Z zombie), the CPU time of its whole tree (utime + stime, in clock ticks) and
the bytes its tree read and wrote (``rchar + wchar``: files, pipes and sockets alike).

What a thread waits in, also without touching it: its state, its wait channel
(``/proc/PID/task/TID/wchan``), the system call it is blocked in (``.../syscall``: a read on a
socket, a poll, a file lock, a sleep) and how often it was switched out (voluntary and
involuntary context switches: a thread that keeps waking up is not frozen). ``waiting_outside``
turns that into words ("a read on a socket", "a file lock", "a sleep", "disk wait (state D)")
when the main thread waits on the world outside the job rather than on the job itself.

A rank is torchrun's direct child: a process with RANK whose parent is a tagged process without
one. Any other process with RANK is a child of the rank with that RANK (a DataLoader worker, a
double-forked helper whose parent has exited), never a second copy of the rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from . import processes
from .processes import descendants

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


# System calls that wait on the world outside the job, by machine: number -> words. A socket
# read, a poll or select (sockets and pipes), a file lock, a sleep, a connect or accept.
_OUTSIDE_CALLS = {
    "x86_64": {
        0: "read",
        17: "read",
        19: "read",
        45: "recvfrom",
        47: "recvmsg",
        7: "poll",
        23: "select",
        232: "epoll_wait",
        281: "epoll_pwait",
        271: "ppoll",
        270: "pselect6",
        73: "flock",
        72: "fcntl",
        35: "nanosleep",
        230: "clock_nanosleep",
        42: "connect",
        43: "accept",
        288: "accept4",
    },
    "aarch64": {
        63: "read",
        67: "read",
        65: "read",
        207: "recvfrom",
        212: "recvmsg",
        73: "ppoll",
        72: "pselect6",
        22: "epoll_pwait",
        32: "flock",
        25: "fcntl",
        101: "nanosleep",
        115: "clock_nanosleep",
        203: "connect",
        202: "accept",
        242: "accept4",
    },
}
_MACHINE = os.uname().machine if hasattr(os, "uname") else ""
_WORDS = {
    "recvfrom": "a read on a socket",
    "recvmsg": "a read on a socket",
    "connect": "a connect on a socket",
    "accept": "an accept on a socket",
    "accept4": "an accept on a socket",
    "poll": "a poll (sockets or pipes)",
    "ppoll": "a poll (sockets or pipes)",
    "select": "a select (sockets or pipes)",
    "pselect6": "a select (sockets or pipes)",
    "epoll_wait": "an epoll wait (sockets or pipes)",
    "epoll_pwait": "an epoll wait (sockets or pipes)",
    "flock": "a file lock",
    "fcntl": "a file lock",
    "nanosleep": "a sleep",
    "clock_nanosleep": "a sleep",
}


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def thread_wait(pid: int, tid: int | None = None) -> dict[str, object]:
    """What one thread (the main thread by default) is doing, as the kernel says: its state,
    wait channel, the system call it is blocked in (name where known, else its number; None
    while it runs) with that call's first argument, and its context switches so far."""
    tid = pid if tid is None else tid
    base = f"/proc/{pid}/task/{tid}"
    stat = _read(f"{base}/stat")
    state = stat.rsplit(")", 1)[-1].split()[0] if stat and ")" in stat else "?"
    wchan = (_read(f"{base}/wchan") or "").strip() or None
    call: str | None = None
    first: int | None = None
    raw = (_read(f"{base}/syscall") or "").split()
    if raw and raw[0].lstrip("-").isdigit():
        number = int(raw[0])
        call = _OUTSIDE_CALLS.get(_MACHINE, {}).get(number, str(number))
        try:
            first = int(raw[1], 16) if len(raw) > 1 else None
        except ValueError:
            first = None
    switches = None
    status = _read(f"{base}/status")
    if status:
        counts = [
            int(line.split()[1])
            for line in status.splitlines()
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
        ]
        switches = sum(counts) if counts else None
    return {"state": state, "wchan": wchan, "syscall": call, "arg": first, "switches": switches}


def _is_socket(pid: int, fd: int | None) -> bool:
    if fd is None:
        return False
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    except OSError:
        return False


def waiting_outside(pid: int, main: dict[str, object]) -> str | None:
    """What the main thread waits on outside the job, in words, or None: a socket read, a poll,
    a file lock, a sleep, or disk wait (state D: a slow or hung mount). A read on a pipe or a
    file is not counted (a pipe from a DataLoader worker is the job's own). A futex (a lock or
    condition between the job's threads) is never outside: a rank blocked on its own lock is
    the classic hang."""
    if main.get("state") == "D":
        return "disk wait (state D: a slow or hung mount)"
    call = main.get("syscall")
    if not isinstance(call, str):
        return None
    if call == "read":
        arg = main.get("arg")
        fd = arg if isinstance(arg, int) else None
        return "a read on a socket" if _is_socket(pid, fd) else None
    return _WORDS.get(call)


def any_thread_waiting_outside(pid: int, threads_kept: int = 32) -> str | None:
    """What the process waits on outside the job, from its main thread, else from any of its
    other threads (a dataset that fetches through a thread pool waits in the pool's threads
    while its main thread waits on a lock for them). An accept is not counted in the other
    threads: multiprocessing's fd-passing listener, which every DataLoader worker that has
    sent a batch keeps, waits in one for good."""
    words = waiting_outside(pid, thread_wait(pid))
    if words is not None:
        return words
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    except (OSError, ValueError):
        return None
    for tid in tids[:threads_kept]:
        wait = thread_wait(pid, tid)
        if wait.get("syscall") in ("accept", "accept4"):
            continue
        words = waiting_outside(pid, wait)
        if words is not None:
            return f"{words} (thread {tid})"
    return None


def threads_in_disk_wait(pid: int) -> int:
    """How many of the process's threads are in state D (a slow or hung mount)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    count = 0
    for tid in tids:
        stat = _read(f"/proc/{pid}/task/{tid}/stat")
        if stat and ")" in stat and stat.rsplit(")", 1)[-1].split()[:1] == ["D"]:
            count += 1
    return count


def find_workers(
    job_id: str, node: str, attempt: str | None = None, *, under: int | None = None
) -> list[Worker]:
    """The job's rank processes here (of ``attempt``, when given), each with its descendants
    (``under``: among that process's descendants only; the agent's own pid from the agent)."""
    tagged = processes.job_processes(job_id, node, attempt, under=under)
    ranks: dict[int, tuple[str, str]] = {}
    for pid in tagged:
        env = environ(pid)
        if "RANK" in env and "LOCAL_RANK" in env:
            ranks[pid] = (env["RANK"], env["LOCAL_RANK"])
    launchers = set(tagged) - set(ranks)  # torchrun (and the agent's own helpers)
    direct = {pid for pid in ranks if parent(pid) in launchers}
    found: dict[str, Worker] = {}
    for pid, (rank, local_rank) in ranks.items():
        if pid not in direct and any(ranks[d][0] == rank for d in direct):
            continue  # a child of the rank (a DataLoader worker, a double-forked helper)
        up = parent(pid)
        if pid not in direct and up in ranks and ranks[up][0] == rank:
            continue  # torchrun is gone: the rank is still the top of its own tree
        try:
            worker = Worker(pid, int(rank), int(local_rank), tuple(descendants(pid)))
        except ValueError:
            continue
        # Children that left the rank's tree (their parent exited) still belong to it.
        strays = [
            other
            for other, (r, _) in ranks.items()
            if r == rank and other != pid and other not in worker.children and other not in direct
        ]
        known = found.get(rank)
        if known is None or (pid in direct and known.pid not in direct):
            found[rank] = Worker(pid, worker.rank, worker.local_rank, (*worker.children, *strays))
    return sorted(found.values(), key=lambda w: w.rank)
