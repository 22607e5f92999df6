"""Real slowdowns of one worker process, for the slow-rank tests and bench/straggler.py.

Each makes the worker s times slower by a cause herd should name, and ``release()`` undoes it:

    Quota       a real cgroup CPU quota on the worker's threads (cpu.max, or v1's cfs quota)
    Busy        a busy process on the worker's node that shares its CPU cgroup and its CPU,
                niced so that its weight is s - 1 times the worker's
    StopAndGo   SIGSTOP and SIGCONT in turn: stopped 1 - 1/s of every period
    SlowLoader  the worker's data-loader worker takes s times the job's step time a batch
                (tests/integration/scripts/heavy.py --loader-control): the rank waits for it

Namespaces share this machine's CPUs, so a busy process must be pinned to the worker's CPU
(and the worker to it) to compete with that worker alone. Needs root.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from tests.testbed import Testbed
from torchherd.agent.node_load import cpu_times

# The kernel's weight for each nice value (sched_prio_to_weight), -5 to 19.
WEIGHTS = {
    -5: 3121, -4: 2501, -3: 1991, -2: 1586, -1: 1277, 0: 1024, 1: 820, 2: 655, 3: 526,
    4: 423, 5: 335, 6: 272, 7: 215, 8: 172, 9: 137, 10: 110, 11: 87, 12: 70, 13: 56,
    14: 45, 15: 36, 16: 29, 17: 23, 18: 18, 19: 15,
}  # fmt: skip


def cpu_ticks(pid: int) -> int:
    """The CPU time the process used so far (user + system), in clock ticks; OSError once it
    is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def cpu_share(pid: int, seconds: float = 5.0) -> float:
    """The share of a CPU the process used over ``seconds``."""
    before = cpu_ticks(pid)
    time.sleep(seconds)
    return (cpu_ticks(pid) - before) / os.sysconf("SC_CLK_TCK") / seconds


class Quota:
    """A CPU cgroup holding one process's threads to a share of a CPU (None: no quota, a
    group to share)."""

    def __init__(self, pid: int, share: float | None) -> None:
        name = f"herd-slow-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        v1 = Path("/sys/fs/cgroup/cpu")
        self.path = (v1 if (v1 / "cpu.cfs_quota_us").exists() else Path("/sys/fs/cgroup")) / name
        self.path.mkdir()
        if share is None:
            pass
        elif (self.path / "cpu.cfs_quota_us").exists():
            (self.path / "cpu.cfs_period_us").write_text("100000")
            (self.path / "cpu.cfs_quota_us").write_text(str(int(max(share, 0.01) * 100000)))
        else:
            (self.path / "cpu.max").write_text(f"{int(max(share, 0.01) * 100000)} 100000")
        self.tasks = "tasks" if (self.path / "tasks").exists() else "cgroup.procs"
        for task in os.listdir(f"/proc/{pid}/task"):  # every thread (v1 moves one at a time)
            self.join(int(task))

    def join(self, task: int) -> None:
        (self.path / self.tasks).write_text(str(task))

    def release(self) -> None:
        if not self.path.exists():
            return
        for _ in range(3):
            for pid in (self.path / self.tasks).read_text().split():
                try:
                    (self.path.parent / self.tasks).write_text(pid)
                except OSError:
                    pass  # gone already
        self.path.rmdir()


def busy_cores(seconds: float = 2.0) -> float:
    """How many of this machine's CPUs were busy over ``seconds`` (herd's own /proc/stat
    reading, the one `herd top` shows)."""
    busy0, total0 = cpu_times()
    time.sleep(seconds)
    busy1, total1 = cpu_times()
    return (busy1 - busy0) / max(1, total1 - total0) * (os.cpu_count() or 1)


def quiet_machine(max_busy: float = 0.5, within: float = 90.0) -> float:
    """Wait until less than ``max_busy`` CPUs are busy (what earlier tests left ending, such
    as a testbed's processes, would be a slowdown of whichever rank shares its CPU); the
    busy CPUs last seen, whether or not it got quiet in time."""
    deadline = time.monotonic() + within
    busy = busy_cores()
    while busy > max_busy and time.monotonic() < deadline:
        busy = busy_cores()
    return busy


def pin(pid: int, cpu: int | str) -> None:
    """Every thread of ``pid`` to ``cpu`` (a number or a list such as "0,1")."""
    subprocess.run(
        ["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True, capture_output=True
    )


class Busy:
    """A busy process on the victim's node that shares its CPU cgroup and CPU, niced so that
    its weight is (s - 1) x the worker's: whenever both want the CPU the worker gets 1/s of
    what the group gets, however busy the rest of the machine is."""

    def __init__(self, bed: Testbed, node: str, pid: int, slowdown: float) -> None:
        wanted = 1024 * (slowdown - 1)
        nice = min(WEIGHTS, key=lambda n: abs(WEIGHTS[n] - wanted))
        self.pid, self.cpus = pid, os.sched_getaffinity(pid)
        cpu = sorted(self.cpus)[0]
        pin(pid, cpu)
        self.process = bed.ns_popen(
            node,
            ["nice", "-n", str(nice), "taskset", "-c", str(cpu), sys.executable, "-c"]
            + ["while True: pass"],
        )
        self.processes = [self.process]
        self.group = Quota(pid, None)
        self.group.join(self.process.pid)

    def release(self) -> None:
        self.process.kill()
        self.process.wait()
        self.group.release()
        try:
            pin(self.pid, ",".join(str(c) for c in sorted(self.cpus)))
        except subprocess.CalledProcessError:
            pass  # the worker is gone


class StopAndGo:
    """SIGSTOP and SIGCONT in turn on the worker: stopped 1 - 1/s of every ``period`` s."""

    def __init__(self, pid: int, slowdown: float, period: float = 1.0) -> None:
        self.pid, self.period = pid, period
        self.stopped_for = period * (1 - 1 / slowdown)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._cycle, daemon=True)
        self.thread.start()

    def _cycle(self) -> None:
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(self.stopped_for)
                os.kill(self.pid, signal.SIGCONT)
                self.done.wait(self.period - self.stopped_for)
        except ProcessLookupError:
            pass  # the worker is gone

    def release(self) -> None:
        self.done.set()
        self.thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


SAMPLES_PER_S = re.compile(r"\b(\d+(?:\.\d+)?)([kMG]?) samples/s")


def step_seconds(lines: list[str], global_batch: int) -> float:
    """A Trainer job's latest step time, from its newest progress line (samples/s)."""
    for line in reversed(lines):
        found = SAMPLES_PER_S.search(line)
        if found:
            scale = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9}[found.group(2)]
            return global_batch / (float(found.group(1)) * scale)
    raise RuntimeError("no progress line yet: the Trainer logs every 50 steps")


class SlowLoader:
    """Rank ``rank``'s data-loader worker takes ``batch_s`` seconds a batch (heavy.py reads
    the control file at most twice a second)."""

    def __init__(self, control: Path, rank: int, batch_s: float) -> None:
        self.control = control
        self.control.write_text(json.dumps({"rank": rank, "batch_s": round(batch_s, 4)}))

    def release(self) -> None:
        self.control.write_text(json.dumps({"rank": -1}))
