"""Scale of the control plane: what the launcher costs per node, from 10 to 1,000 nodes.

On the simulated cluster (tests/simcluster: herd's real node agents on this machine, each node
a host of its own, a stand-in only for torchrun and torch), for each N: the launcher (herd's
own launch, one process: tests/simcluster/launcher.py) starts a job of N nodes x NPROC ranks,
and the bench measures that process alone (its own CPU time and peak RSS from /proc; the
agents are its children and are not counted). Above --tree-above nodes (64) the launcher
reaches them through herd's tree of agents, as a launch at scale does over ssh and as Slurm's
and PBS's steps do: a few inner nodes start the others' relays, and every node's agent links
back to the launcher over TCP (a relay link, not a process, on the launcher's side):

  start      command -> every node's torchrun (stand-in) running: wall time, launcher CPU
  waiting    every node running, its ranks still held (as before a rendezvous completes),
             for a few seconds: the launcher's CPU per second, which is what the nodes up
             so far cost it while this machine started the others (the start's waiting)
  steady     every rank printing 1 line/s and beating once a second with its compute time,
             as the Trainer does (--steady-lines, --steady-beats, --plain-ranks): launcher
             CPU per minute
  full       every rank printing 10 lines/s: launcher CPU, lines the launcher took per second
             of those sent to it (every line up to 16 nodes; above, rank 0's, herd's default:
             the rest stay on their nodes), and the worst line delay (a line's time stamp ->
             the launcher writing it to the job's output.log; the agents' heartbeats travel
             in the same stream, so they are this late too), besides the delay to the
             console (stdout). Simulated up to
             --full-max-nodes (100): beyond, the nodes' own side of 80 lines/s per node (an
             agent relaying every line) takes this machine's 2 cores, and a measured delay
             would be the simulation's; there the launcher's load is projected from its CPU
             per line at the largest N measured
  silent     one node freezes (its agent stopped, as a machine that hangs): seconds until the
             launcher says it stopped answering, then until the launcher has stopped every
             node and exited (it first takes the other nodes' stacks), waited for up to
             --stop-wait seconds (on this machine every node's agent reads the one /proc of
             all N x 10 processes to find and sweep its own, which a real node does not)
  misjudged  any node called lost or failed that was not the frozen one, or an agent that
             stopped its job for want of the launcher's pings, before the frozen node was
             noticed (after it, herd takes every node's stacks: N x 8 py-spy on this
             machine's cores, which starves agents; those are counted apart)

Then the growth from the smallest to the largest N as ratios, and the targets with met / not
met lines:
  - launcher CPU per node at start <= 5 ms;
  - steady: <= 0.5 % of a core per 100 nodes;
  - start of the largest N within 2x the start of the smallest, agent start excluded: on this
    machine every node's agent and probe share 2 cores, so the wall time grows with N for the
    simulation's sake; what a real cluster adds is the launcher's own extra work, so the bench
    judges start(small) + launcher CPU(large) - launcher CPU(small) against 2 x start(small);
    and the same with the start's waiting taken out of each launcher CPU (the fork server
    starts 1,000 nodes over ~40 s, one after the other, and the nodes up meanwhile say
    "alive" and are pinged: a real cluster's nodes start at once) and put back over the
    judged start itself, as if every node waited from its first second;
  - worst line (heartbeat) delay <= 1 s with every rank at 10 lines/s;
  - no node loss misjudged at any N.

A simulated node is herd's agent and torchrun's stand-in, both forked from one process that
imported them (tests/simcluster/forkserver.py; about 8 and 4 MB of their own: CPython's
reference counts unshare what the code touches), two waiting shells and NPROC sleeping
workers: about 13 MB a node. An N that does not fit in the memory available now is skipped,
with the reason. The fork server is started before the clock: on a real cluster every node
has its interpreter already, and the agents' start is excluded from the judged start anyway.

    python bench/scale.py [--nodes 10,100,300,1000] [--nproc 8] [--steady 60] [--full 20]
                          [--full-max-nodes 100] [--steady-lines 1] [--steady-beats 1]
                          [--plain-ranks] [--stop-wait S] [--json FILE] [--profile DIR]
                          [--ranks-beat-early] [--tree-above N]

With --profile, py-spy samples the launcher during the start, steady and full-speed phases
(raw stacks in DIR) and the bench prints where its CPU went: the functions with the most
samples, as CPU ms per node (start), per node and minute (steady) and CPU us per line (full
speed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(1, str(REPO))
from tests.simcluster import SimCluster  # noqa: E402
from torchherd.launcher.attempt import LARGE_JOB_NODES  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
START_TARGET_MS = 5.0
STEADY_TARGET = 0.5  # % of a core per 100 nodes
START_RATIO_TARGET = 2.0
DELAY_TARGET = 1.0
FULL_RATE = 10.0


def lines_sent_per_s(nodes: int, nproc: int, rate: float) -> float:
    """Lines per second the agents send the launcher when every rank prints ``rate``: all of
    them on a small job; rank 0's on a large one (the rest stay on their nodes, herd's
    default above LARGE_JOB_NODES nodes)."""
    return (nodes * nproc if nodes <= LARGE_JOB_NODES else 1) * rate


# What every rank does in steady running (set from --steady-lines and --steady-beats). Beats
# carry a compute time, as the Trainer's do: herd then judges slow ranks from the beats. A job
# that reports none is looked at instead (py-spy on each rank every 10 s, on its node): on
# this machine, 300 nodes' looks take both cores from the simulation (--plain-ranks).
STEADY: dict[str, float | None] = {
    "lines_per_second": 1.0,
    "beats_per_second": 1.0,
    "compute_seconds": 0.1,
}
# Processes and threads a simulated node holds while herd stops a job taking every rank's
# stacks (shims, agent and its threads, stand-in, 8 workers; 8 py-spy and their threads).
TASKS_PER_NODE_AT_STOP = 45
with open("/proc/sys/kernel/pid_max") as _handle:
    PID_MAX = int(_handle.read())
# Seconds the bench waits for the launcher to have stopped every node after the lost one
# (--stop-wait).
STOP_WAIT = {"seconds": 600.0}
# The ranks of a real job neither print nor step until the rendezvous is complete, that is until
# every node's torchrun is running: the stand-ins' ranks are held ("hang" in the control file)
# until the bench has seen every node run. --ranks-beat-early lets them beat from their own
# node's start instead (a long simulated start then also counts the first nodes' steady
# running). Holding them once starved this machine at 1,000 nodes (start 147-483 s instead of
# ~40): every look at a waiting node's ranks read the environment of all ~11,000 processes on
# the machine; an agent now finds its ranks among its own descendants.
HOLD_UNTIL_ALL_RUN = {"on": True}
# Above this many nodes (--tree-above) the launcher reaches the nodes through herd's tree of
# agents (transport/tree.py), as a launch at scale does over ssh (herd launch --tree-above) and
# as Slurm's and PBS's steps do (a relay link a node): a process a node for the launcher (flat
# ssh's clients) is what the tree exists to avoid. 0: never.
TREE_ABOVE = {"nodes": 64}
# Seconds the ranks stay held once every node runs, to measure what waiting nodes cost.
WAITING_FOR = 6.0
SILENT_FOR = 20.0  # longer than herd's 10 s of silence, so the node is called lost
# Memory a simulated node takes until measured (agent ~8 MB, stand-in ~4, workers and shims
# ~1), and what is left free for everything else on the machine.
NODE_MB_GUESS = 14.0
RESERVE_MB = 2048.0
STAMP = re.compile(rb"at=(\d+\.\d+)")
NOTICED = re.compile(r"herd: (\S+) stopped answering")
MISJUDGED = re.compile(
    r"herd: (\S+) (?:stopped answering|failed; stopping)|no word from the launcher"
)


@dataclass
class Result:
    nodes: int
    nproc: int
    tree: bool = False
    """The launcher reached the nodes through herd's tree (a relay link a node)."""
    start_s: float = 0.0
    start_cpu_s: float = 0.0
    start_rss_mb: float = 0.0
    waiting_cpu_per_s: float | None = None
    """The launcher's CPU per second with every node up and its ranks held (as before the
    rendezvous completes): what nodes that wait for the others cost it."""
    start_waiting_cpu_s: float = 0.0
    """Of the start's launcher CPU, what the nodes already up cost while the simulation
    started the others (each node, from its stand-in's start to the last node's run, at the
    waiting rate per node)."""
    steady_cpu_per_min_s: float = 0.0
    steady_rss_mb: float = 0.0
    full_measured: bool = False
    full_cpu_per_s: float = 0.0
    full_lines_per_s: float = 0.0
    full_sent_lines_per_s: float = 0.0
    worst_delay_s: float = 0.0
    worst_console_delay_s: float = 0.0
    steady_worst_delay_s: float = 0.0
    notice_s: float | None = None
    stop_s: float | None = None
    gone_s: float | None = None
    peak_rss_mb: float = 0.0
    node_mb: float = 0.0
    misjudged: list[str] = field(default_factory=list)
    lost_while_stopping: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    profile: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# the launcher process, from /proc


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process itself (its children are not counted)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def status_mb(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def available_mb() -> float:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


def pss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as handle:
                for line in handle:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total / 1024


# ---------------------------------------------------------------------------------------------
# reading what the launcher writes


class Delays:
    """Worst delay of time-stamped lines read from a stream, within a window that can be reset."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.worst = 0.0
        self.stamps = 0

    def take(self, chunk: bytes) -> None:
        now = time.time()
        stamps = STAMP.findall(chunk)
        if not stamps:
            return
        oldest = min(float(s) for s in stamps)
        with self.lock:
            self.worst = max(self.worst, now - oldest)
            self.stamps += len(stamps)

    def reset(self) -> tuple[float, int]:
        with self.lock:
            worst, stamps = self.worst, self.stamps
            self.worst, self.stamps = 0.0, 0
        return worst, stamps


class Console:
    """The launcher's stdout: herd's own notes (with the time they came), line delays."""

    def __init__(self, stream: int) -> None:
        self.stream = stream
        self.notes: list[tuple[float, str]] = []
        self.delays = Delays()
        self.job_id: str | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        pending = b""
        while True:
            chunk = os.read(self.stream, 1 << 20)
            if not chunk:
                return
            self.delays.take(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                if b"at=" in raw:
                    continue
                text = raw.decode(errors="replace")
                self.notes.append((time.time(), text))
                found = re.search(r"herd \S+: job (\S+) on", text)
                if found:
                    self.job_id = found.group(1)

    def first(self, pattern: re.Pattern[str], after: float = 0.0) -> tuple[float, str] | None:
        for at, text in list(self.notes):
            if at >= after and pattern.search(text):
                return at, text
        return None


class LogTail:
    """Follows the job's output.log (written by the launcher's event loop) for line delays."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.delays = Delays()
        self.lines = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        while not self.path.exists() and not self.stopped.wait(0.1):
            pass
        if self.stopped.is_set():
            return
        with open(self.path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            while not self.stopped.is_set():
                chunk = handle.read(1 << 22)
                if not chunk:
                    time.sleep(0.05)
                    continue
                self.delays.take(chunk)
                self.lines += chunk.count(b"\n")

    def stop(self) -> None:
        self.stopped.set()


# ---------------------------------------------------------------------------------------------
# where the launcher's CPU goes (py-spy)


class Profiler:
    """py-spy recording one process until stopped; raw stacks (``frame;frame;... count``)."""

    def __init__(self, pid: int, path: Path) -> None:
        self.path = path
        argv = ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--output", str(path)]
        argv += ["--rate", "200", "--nolineno", "--nonblocking"]
        for _ in range(50):  # a process that just started is not Python yet for py-spy
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            try:
                self.process.wait(0.3)
            except subprocess.TimeoutExpired:
                return  # it is sampling

    def stop(self) -> Path:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # py-spy writes what it has, then exits
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        return self.path


def hot_spots(path: Path, cpu_seconds: float, per: float, unit: str, top: int = 14) -> list[str]:
    """The functions with the most samples: self and inclusive, as CPU per ``unit``."""
    own: dict[str, int] = {}
    within: dict[str, int] = {}
    total = 0
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return [f"  (no profile in {path})"]
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f and not f.startswith("process ")]
        if not frames:
            continue
        total += count
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            within[frame] = within.get(frame, 0) + count
    if not total:
        return ["  (no samples)"]
    scale = cpu_seconds / total / per
    factor = 1e6 if unit == "line" else 1e3
    name = "us" if unit == "line" else "ms"
    lines = [f"  self ({name} of launcher CPU per {unit}; {total} samples):"]
    for frame, count in sorted(own.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"    {count * scale * factor:8.2f}  {count * 100 / total:5.1f} %  {frame}")
    lines.append(f"  inclusive, herd's own functions ({name} per {unit}):")
    ours = [(f, c) for f, c in within.items() if "torchherd" in f or "simcluster" in f]
    for frame, count in sorted(ours, key=lambda item: -item[1])[:top]:
        lines.append(f"    {count * scale * factor:8.2f}  {count * 100 / total:5.1f} %  {frame}")
    return lines


# ---------------------------------------------------------------------------------------------
# one N


class Run:
    """One launch on the simulated cluster: the launcher process and what it writes."""

    def __init__(self, sim: SimCluster, profile: Path | None) -> None:
        self.sim = sim
        env = dict(os.environ, HERD_HOME=str(sim.home), PYTHONPATH=f"{REPO / 'src'}:{REPO}")
        self.stderr = open(sim.root / "launcher.err", "ab")  # noqa: SIM115 - closed in end()
        self.events_before = len(sim.events())
        # The nodes' agents are forked from one process (tests/simcluster/forkserver.py),
        # started before the clock: on a real cluster every node has its interpreter already.
        self.server = sim.start_forkserver()
        self.started = time.time()
        tree = ["--tree-above", str(TREE_ABOVE["nodes"])] if TREE_ABOVE["nodes"] else []
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "tests.simcluster.launcher", str(sim.root), "--grace", "5"]
            + tree,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )
        assert self.launcher.stdout is not None
        self.console = Console(self.launcher.stdout.fileno())
        self.profile = profile
        self.tail: LogTail | None = None

    @property
    def pid(self) -> int:
        return self.launcher.pid

    @property
    def alive(self) -> bool:
        return self.launcher.poll() is None

    def wait_running(self, nodes: int) -> float | None:
        """Seconds from the command to every node's stand-in running (None: not in time)."""
        deadline = time.monotonic() + 120 + nodes
        while time.monotonic() < deadline and self.alive:
            started = self.event_times("run")
            if len(started) >= nodes:
                assert self.console.job_id is not None, self.console.notes
                self.tail = LogTail(self.sim.home / "jobs" / self.console.job_id / "output.log")
                return max(started.values()) - self.started
            time.sleep(0.2)
        return None

    def event_times(self, kind: str) -> dict[int, float]:
        """node -> when its stand-in did ``kind`` (run, silent, exit) in this launch."""
        found: dict[int, float] = {}
        for what, node, at, _ in self.sim.events()[self.events_before :]:
            if what == kind:
                found.setdefault(node, at)
        return found

    def misjudged(self, frozen: str | None = None, until: float | None = None) -> list[str]:
        """Nodes called lost or failed (or agents that gave up on the launcher) other than
        ``frozen``, before ``until`` (default: all)."""
        found = []
        for at, text in self.console.notes:
            match = MISJUDGED.search(text)
            if match and (match.group(1) or "") != frozen and (until is None or at < until):
                found.append(text)
        return found

    def said(self) -> list[str]:
        """What the launcher said besides the per-node lines of its summary."""
        notes = [t for _, t in self.console.notes if not re.match(r"\s+sim\d+\s+\w+$", t)]
        errors = (self.sim.root / "launcher.err").read_text(errors="replace").strip()
        return notes[-30:] + [f"stderr: {line}" for line in errors.splitlines()[-20:]]

    def end(self) -> None:
        if self.tail is not None:
            self.tail.stop()
        self.server.terminate()  # no new agents; it exits with the last one
        end(self.launcher, self.sim)
        self.stderr.close()


def measure(
    nodes: int,
    nproc: int,
    steady: float,
    full: float | None,
    scratch: Path,
    profile: Path | None,
) -> Result:
    """Start, steady running and full speed in one launch; the frozen node in the same one
    when it survived full speed, else in a second launch."""
    result = Result(nodes, nproc, tree=0 < TREE_ABOVE["nodes"] < nodes)
    # The nodes' files (beats every second from every rank) on a tmpfs: they are other
    # machines' disks, and must not slow the launcher's own.
    node_home = Path(tempfile.mkdtemp(prefix="herd-scale-nodes-", dir="/dev/shm"))
    # Every node's stacks at the stop (N x NPROC py-spy and their threads at once) must fit in
    # this machine's process table beside the simulation's own processes and threads.
    py_spy = nodes * TASKS_PER_NODE_AT_STOP < 0.8 * PID_MAX
    if not py_spy:
        result.notes.append(
            f"{nodes} nodes: the simulated nodes have no py-spy (herd reports it missing "
            f"instead of the stacks): {nodes} x ~{TASKS_PER_NODE_AT_STOP} processes and "
            f"threads at the stop would not fit this machine's {PID_MAX} pids"
        )
    hold = {"hang": True} if HOLD_UNTIL_ALL_RUN["on"] else {}
    sim = SimCluster(scratch / f"sim{nodes}", nodes, nproc, node_home, py_spy)
    sim.build(**STEADY, **hold)
    run = Run(sim, profile)
    try:
        profiler = Profiler(run.pid, profile / f"start-{nodes}.txt") if profile else None
        started = run.wait_running(nodes)
        if started is None:
            result.problems += ["not every node running in time", *run.said()]
            return result
        result.start_s = started
        result.start_cpu_s = cpu_seconds(run.pid)
        result.start_rss_mb = status_mb(run.pid, "VmHWM")
        if profiler is not None:
            result.profile += [f"start, {nodes} nodes:"]
            result.profile += hot_spots(profiler.stop(), result.start_cpu_s, nodes, "node")
        print(f"  {nodes} nodes running after {result.start_s:.1f} s", flush=True)
        if hold:
            waiting_phase(run, result)
            sim.set_control(**STEADY)  # the rendezvous is complete: the ranks step
        steady_phase(run, result, steady, profile)
        result.full_sent_lines_per_s = lines_sent_per_s(nodes, nproc, FULL_RATE)
        if full:
            full_phase(run, result, full, profile)
        if not run.alive or run.misjudged():
            result.misjudged += run.misjudged()
            print("  misjudged at full speed; a second launch for the frozen node", flush=True)
            run.end()
            run = Run(sim, None)
            if run.wait_running(nodes) is None:
                result.problems += ["not every node running in time (again)", *run.said()]
                return result
        silent_phase(run, result)
        return result
    finally:
        run.end()
        shutil.rmtree(node_home, ignore_errors=True)


def waiting_phase(run: Run, result: Result) -> None:
    """The launcher's CPU per second while every node waits with its ranks held, and what
    that waiting cost it during the start: on this machine the fork server starts the nodes
    one after the other over many seconds (a real cluster's nodes start at once), and every
    node up meanwhile says "alive" and is pinged, which is the waiting's cost, not the start's
    work per node."""
    before, since = cpu_seconds(run.pid), time.monotonic()
    time.sleep(WAITING_FOR)
    rate = (cpu_seconds(run.pid) - before) / (time.monotonic() - since)
    result.waiting_cpu_per_s = rate
    warm, ran = run.event_times("warm"), run.event_times("run")
    if warm and ran:
        last = max(ran.values())
        node_seconds = sum(max(0.0, last - up) for up in warm.values())
        result.start_waiting_cpu_s = rate / result.nodes * node_seconds
    print(f"  waiting: {rate * 1000:.1f} ms CPU/s", flush=True)


def start_work_s(result: Result) -> float:
    """The launcher's CPU at start less what the nodes' waiting cost it meanwhile."""
    return result.start_cpu_s - result.start_waiting_cpu_s


def steady_phase(run: Run, result: Result, seconds: float, profile: Path | None) -> None:
    assert run.tail is not None
    time.sleep(min(10.0, seconds))  # the first beats and lines settle
    run.tail.delays.reset()
    before = cpu_seconds(run.pid)
    profiler = Profiler(run.pid, profile / f"steady-{result.nodes}.txt") if profile else None
    time.sleep(seconds)
    spent = cpu_seconds(run.pid) - before
    result.steady_cpu_per_min_s = spent * 60 / seconds
    if profiler is not None:
        result.profile += [f"steady, {result.nodes} nodes (per node and minute):"]
        result.profile += hot_spots(profiler.stop(), spent, result.nodes * seconds / 60, "node")
    result.steady_rss_mb = status_mb(run.pid, "VmRSS")
    result.steady_worst_delay_s = run.tail.delays.reset()[0]
    result.node_mb = pss_mb(run.sim.processes()) / result.nodes
    print(f"  steady: {result.steady_cpu_per_min_s:.2f} s CPU/min", flush=True)


def full_phase(run: Run, result: Result, seconds: float, profile: Path | None) -> None:
    assert run.tail is not None
    run.sim.set_control(**(STEADY | {"lines_per_second": FULL_RATE}))
    time.sleep(2.0)  # every stand-in has read the new rate
    run.tail.delays.reset()
    run.console.delays.reset()
    lines_before, before = run.tail.lines, cpu_seconds(run.pid)
    profiler = Profiler(run.pid, profile / f"full-{result.nodes}.txt") if profile else None
    deadline = time.monotonic() + seconds
    last = before
    while time.monotonic() < deadline and run.alive:
        try:
            last = cpu_seconds(run.pid)
        except OSError:
            break
        time.sleep(0.2)
    took = seconds - max(0.0, deadline - time.monotonic())
    result.full_measured = True
    result.full_cpu_per_s = (last - before) / took
    result.full_lines_per_s = (run.tail.lines - lines_before) / took
    result.full_sent_lines_per_s = lines_sent_per_s(result.nodes, result.nproc, FULL_RATE)
    result.worst_delay_s = run.tail.delays.reset()[0]
    result.worst_console_delay_s = run.console.delays.reset()[0]
    if profiler is not None:
        result.profile += [f"full speed, {result.nodes} nodes:"]
        result.profile += hot_spots(
            profiler.stop(), last - before, result.full_lines_per_s * took, "line"
        )
    print(
        f"  full speed: {result.full_lines_per_s:.0f} of {result.full_sent_lines_per_s:.0f} "
        f"lines/s taken, worst delay {result.worst_delay_s:.2f} s",
        flush=True,
    )
    run.sim.set_control(**STEADY)
    time.sleep(5.0)  # the backlog drains


def silent_phase(run: Run, result: Result) -> None:
    """One node freezes: until the launcher says so, then until it has stopped everything."""
    frozen = result.nodes // 2
    run.sim.set_control(**STEADY, silent={"nodes": [frozen], "seconds": SILENT_FOR})
    silent = [at for kind, node, at, _ in run.sim.events()[run.events_before :] if kind == "silent"]
    deadline = time.monotonic() + 30
    while not silent and time.monotonic() < deadline:
        time.sleep(0.2)
        silent = [
            at for kind, _, at, _ in run.sim.events()[run.events_before :] if kind == "silent"
        ]
    if not silent:
        result.problems += ["the frozen node never went silent", *run.said()]
        return
    noticed = wait_for(lambda: run.console.first(NOTICED, after=silent[0]), 60)
    if noticed is None:
        result.problems += [f"sim{frozen} froze, and the launcher never noticed", *run.said()]
        return
    result.notice_s = noticed[0] - silent[0]
    result.peak_rss_mb = max(result.start_rss_mb, result.steady_rss_mb)
    deadline = time.monotonic() + STOP_WAIT["seconds"]
    while run.alive and time.monotonic() < deadline:
        try:  # the high-water mark, while the process is there to ask
            result.peak_rss_mb = max(result.peak_rss_mb, status_mb(run.pid, "VmHWM"))
        except OSError:
            pass
        time.sleep(0.2)
    if run.alive:
        # Not a failure of herd's: stopping takes every rank's stacks and sweeps every node's
        # processes, which on one machine is N agents reading one /proc of N x 10 processes.
        result.notes.append(
            f"{result.nodes} nodes: the launcher was still stopping the nodes "
            f"{STOP_WAIT['seconds']:g} s after the lost node (--stop-wait); not waited for"
        )
    else:
        result.stop_s = time.time() - noticed[0]
        run.server.terminate()  # it exits with the last process it forked
        left = wait_for(lambda: None if run.sim.processes() else True, 120)
        result.gone_s = time.time() - noticed[0] if left else None
    result.misjudged += run.misjudged(frozen=f"sim{frozen}", until=noticed[0])
    # Once herd noticed the frozen node it takes every other node's stacks (8 py-spy a node):
    # on one machine that is N x 8 py-spy on its cores, which can starve agents of CPU; what
    # is called lost then is the simulation's doing, counted apart.
    result.lost_while_stopping = len(run.misjudged(frozen=f"sim{frozen}")) - len(
        run.misjudged(frozen=f"sim{frozen}", until=noticed[0])
    )
    print(f"  sim{frozen} noticed after {result.notice_s:.1f} s", flush=True)


def wait_for(check, timeout: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    return None


def end(launcher: subprocess.Popen[bytes], sim: SimCluster) -> None:
    """Whatever still runs after a measurement: the launcher, then the simulated nodes."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.wait(120)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
    for sig in (signal.SIGCONT, signal.SIGKILL):
        for pid in sim.processes():
            try:
                os.kill(pid, sig)
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# the report


def per_node_ms(seconds: float, nodes: int) -> float:
    return seconds * 1000 / nodes


def steady_share(result: Result) -> float:
    """Launcher CPU in steady running, as % of one core per 100 nodes."""
    return result.steady_cpu_per_min_s / 60 * 100 / (result.nodes / 100)


def table(results: list[Result]) -> str:
    rows = [
        ("nodes reached", lambda r: "tree" if r.tree else "flat"),
        ("start: wall s", lambda r: f"{r.start_s:.1f}"),
        ("start: launcher CPU s", lambda r: f"{r.start_cpu_s:.2f}"),
        ("start: CPU ms / node", lambda r: f"{per_node_ms(r.start_cpu_s, r.nodes):.1f}"),
        ("start: of which nodes waiting s", lambda r: f"{r.start_waiting_cpu_s:.2f}"),
        ("start: work ms / node", lambda r: f"{per_node_ms(start_work_s(r), r.nodes):.1f}"),
        ("start: peak RSS MB", lambda r: f"{r.start_rss_mb:.0f}"),
        ("waiting: launcher ms CPU / s", lambda r: _ms(r.waiting_cpu_per_s)),
        ("steady: CPU s / min", lambda r: f"{r.steady_cpu_per_min_s:.2f}"),
        ("steady: % core / 100 nodes", lambda r: f"{steady_share(r):.2f}"),
        ("steady: RSS MB", lambda r: f"{r.steady_rss_mb:.0f}"),
        ("steady: RSS KB / node", lambda r: f"{r.steady_rss_mb * 1024 / r.nodes:.0f}"),
        ("steady: worst delay s", lambda r: f"{r.steady_worst_delay_s:.2f}"),
        ("full: lines/s printed", lambda r: f"{r.nodes * r.nproc * FULL_RATE:.0f}"),
        ("full: lines/s sent", lambda r: f"{r.full_sent_lines_per_s:.0f}"),
        ("full: lines/s taken", lambda r: _full(r, f"{r.full_lines_per_s:.0f}")),
        ("full: launcher % core", lambda r: _full(r, f"{r.full_cpu_per_s * 100:.0f}")),
        ("full: CPU us / line", lambda r: _full(r, f"{cpu_per_line_us(r):.0f}")),
        ("full: projected % core", lambda r: f"{projected_core(r, results):.0f}"),
        ("full: worst delay s", lambda r: _full(r, f"{r.worst_delay_s:.2f}")),
        ("full: worst console delay s", lambda r: _full(r, f"{r.worst_console_delay_s:.2f}")),
        ("silent node noticed after s", lambda r: _maybe(r.notice_s)),
        ("then launcher done after s", lambda r: _maybe(r.stop_s)),
        ("then nodes all gone after s", lambda r: _maybe(r.gone_s)),
        ("launcher peak RSS MB", lambda r: f"{r.peak_rss_mb:.0f}"),
        ("simulated node MB (PSS)", lambda r: f"{r.node_mb:.1f}"),
        ("misjudged", lambda r: str(len(r.misjudged))),
        ("measured in full", lambda r: "no" if r.problems else "yes"),
        ("called lost while stopping", lambda r: str(r.lost_while_stopping)),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [
        f"{'nodes x ranks'.ljust(width)}  "
        + "  ".join(f"{r.nodes}x{r.nproc}".rjust(9) for r in results)
    ]
    for name, value in rows:
        lines.append(f"{name.ljust(width)}  " + "  ".join(value(r).rjust(9) for r in results))
    return "\n".join(lines)


def _full(result: Result, text: str) -> str:
    return text if result.full_measured else "-"


def projected_core(result: Result, results: list[Result]) -> float:
    """The launcher's % of a core at full speed: the asked lines at the CPU per line of the
    largest N where full speed was measured."""
    measured = [r for r in results if r.full_measured and r.full_lines_per_s]
    if not measured:
        return 0.0
    per_line = cpu_per_line_us(measured[-1]) / 1e6
    return result.full_sent_lines_per_s * per_line * 100


def cpu_per_line_us(result: Result) -> float:
    if not result.full_lines_per_s:
        return 0.0
    return result.full_cpu_per_s / result.full_lines_per_s * 1e6


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _maybe(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def maybe_ratio(small: float | None, large: float | None) -> str:
    """xRATIO, or "-" where either was not measured."""
    return f"x{large / small:.2f}" if small and large is not None else "-"


def ratios(small: Result, large: Result) -> list[str]:
    def ratio(a: float, b: float) -> str:
        return f"{b / a:.2f}" if a else "-"

    growth = large.nodes / small.nodes
    return [
        f"growth from {small.nodes} to {large.nodes} nodes (x{growth:g} nodes):",
        f"  start wall time               x{ratio(small.start_s, large.start_s)}",
        f"  start launcher CPU            x{ratio(small.start_cpu_s, large.start_cpu_s)}",
        "  start CPU per node            "
        f"x{ratio(small.start_cpu_s / small.nodes, large.start_cpu_s / large.nodes)}",
        f"  steady CPU                    "
        f"x{ratio(small.steady_cpu_per_min_s, large.steady_cpu_per_min_s)}",
        f"  launcher RSS (steady)         x{ratio(small.steady_rss_mb, large.steady_rss_mb)}",
        "  worst delay (full speed)      "
        + (
            f"x{ratio(small.worst_delay_s, large.worst_delay_s)}"
            if large.full_measured
            else "- (not simulated at this N)"
        ),
        f"  silent node noticed after     {maybe_ratio(small.notice_s, large.notice_s)}",
        f"  launcher done after           {maybe_ratio(small.stop_s, large.stop_s)}",
    ]


def targets(results: list[Result]) -> list[str]:
    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = ["targets:"]
    for r in results:
        per_node = per_node_ms(r.start_cpu_s, r.nodes)
        lines.append(
            f"  {r.nodes:>5} nodes: start CPU {per_node:.1f} ms/node (<= {START_TARGET_MS:g}): "
            f"{verdict(per_node <= START_TARGET_MS)}; steady {steady_share(r):.2f} % core/100 "
            f"nodes (<= {STEADY_TARGET}): {verdict(steady_share(r) <= STEADY_TARGET)}"
        )
    small, large = results[0], results[-1]
    launcher_bound = small.start_s + large.start_cpu_s - small.start_cpu_s
    lines.append(
        f"  start of {large.nodes} vs {small.nodes}, agent start excluded: "
        f"{launcher_bound:.1f} s vs {small.start_s:.1f} s, ratio "
        f"{launcher_bound / small.start_s:.2f} (<= {START_RATIO_TARGET:g}): "
        f"{verdict(launcher_bound <= START_RATIO_TARGET * small.start_s)}"
        f"  (as measured here, wall: {large.start_s:.1f} s)"
    )
    if large.waiting_cpu_per_s is not None:
        # The same, with what the nodes up so far cost while this machine started the others
        # taken out, and their waiting over the judged start itself put back (every node up
        # from the first second: an upper bound).
        work = small.start_s + start_work_s(large) - start_work_s(small)
        waited = work / max(0.05, 1.0 - large.waiting_cpu_per_s)
        lines.append(
            f"  start of {large.nodes} vs {small.nodes}, the launcher's start work (its nodes' "
            f"waiting over {large.start_s:.0f} s of simulated start taken out, over this start "
            f"put back): {waited:.1f} s vs {small.start_s:.1f} s, ratio "
            f"{waited / small.start_s:.2f} (<= {START_RATIO_TARGET:g}): "
            f"{verdict(waited <= START_RATIO_TARGET * small.start_s)}"
        )
    for r in results:
        if not r.full_measured:
            lines.append(
                f"  {r.nodes:>5} nodes: worst delay at {FULL_RATE:g} lines/s per rank: not "
                f"simulated here; the launcher would need {projected_core(r, results):.0f} % "
                f"of a core for them: "
                + verdict(projected_core(r, results) < 50)
                + " (judged as: < 50 % of a core, room for its heartbeats)"
            )
            continue
        fed = r.full_lines_per_s >= 0.9 * r.full_sent_lines_per_s
        note = (
            ""
            if fed
            else f" (only {r.full_lines_per_s:.0f} of {r.full_sent_lines_per_s:.0f} lines/s "
            "reached it)"
        )
        lines.append(
            f"  {r.nodes:>5} nodes: worst delay at {FULL_RATE:g} lines/s per rank "
            f"{r.worst_delay_s:.2f} s (<= {DELAY_TARGET:g}): "
            f"{verdict(r.worst_delay_s <= DELAY_TARGET and fed)}{note}"
        )
    misjudged = [(r.nodes, text) for r in results for text in r.misjudged]
    lines.append(
        f"  no node loss misjudged at any N: {verdict(not misjudged)}"
        + "".join(f"\n    {n} nodes: {text}" for n, text in misjudged)
    )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="10,100,300,1000", help="node counts, comma-separated")
    parser.add_argument("--nproc", type=int, default=8, help="ranks per node")
    parser.add_argument("--steady", type=float, default=60.0, help="seconds of steady running")
    parser.add_argument("--full", type=float, default=20.0, help="seconds at full speed")
    parser.add_argument(
        "--steady-lines", type=float, default=1.0, help="lines per second per rank, steady"
    )
    parser.add_argument(
        "--steady-beats", type=float, default=1.0, help="step beats per second per rank, steady"
    )
    parser.add_argument(
        "--plain-ranks",
        action="store_true",
        help="beats without compute times (a plain script: herd looks at the ranks instead)",
    )
    parser.add_argument(
        "--full-max-nodes",
        type=int,
        default=100,
        help="simulate full speed up to this many nodes (above: projected)",
    )
    parser.add_argument(
        "--stop-wait",
        type=float,
        default=600.0,
        help="seconds to wait for the launcher to stop every node after the lost one",
    )
    parser.add_argument(
        "--tree-above",
        type=int,
        default=TREE_ABOVE["nodes"],
        help="reach more nodes than this through herd's tree of agents, as herd launch "
        f"--tree-above does over ssh (default {TREE_ABOVE['nodes']}; 0: never)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--ranks-beat-early",
        action="store_true",
        help="ranks print and beat from their own node's start; by default they wait until "
        "every node runs, as after a real rendezvous",
    )
    parser.add_argument(
        "--profile", type=Path, default=None, help="sample the launcher with py-spy, stacks here"
    )
    args = parser.parse_args()
    if args.tree_above < 0:
        parser.error(f"--tree-above {args.tree_above}: give a node count, or 0 for never")
    STEADY.update(lines_per_second=args.steady_lines, beats_per_second=args.steady_beats)
    STOP_WAIT["seconds"] = args.stop_wait
    TREE_ABOVE["nodes"] = args.tree_above
    HOLD_UNTIL_ALL_RUN["on"] = not args.ranks_beat_early
    if args.plain_ranks:
        STEADY["compute_seconds"] = None
    counts = [int(n) for n in args.nodes.split(",")]
    results: list[Result] = []
    node_mb = NODE_MB_GUESS
    with tempfile.TemporaryDirectory(prefix="herd-scale-") as scratch:
        for nodes in counts:
            need = nodes * node_mb * 1.1 + RESERVE_MB
            free = available_mb()
            if need > free:
                print(
                    f"{nodes} nodes: skipped: they need about {need / 1024:.1f} GiB "
                    f"({node_mb:.0f} MB per simulated node), {free / 1024:.1f} GiB available",
                    flush=True,
                )
                continue
            print(f"{nodes} nodes x {args.nproc} ranks:", flush=True)
            if args.profile:
                args.profile.mkdir(parents=True, exist_ok=True)
            full = args.full if nodes <= args.full_max_nodes else None
            result = measure(nodes, args.nproc, args.steady, full, Path(scratch), args.profile)
            for problem in result.problems[:12]:
                print(f"  problem: {problem}", flush=True)
            for note in result.notes:
                print(f"  note: {note}", flush=True)
            if result.node_mb:
                node_mb = max(node_mb * 0.5, result.node_mb)
            if result.start_s:  # what was measured counts, the rest shows as "-"
                results.append(result)
    if not results:
        print("no measurement")
        return 1
    print()
    print(table(results))
    if len(results) > 1:
        print()
        print("\n".join(ratios(results[0], results[-1])))
    print()
    print("\n".join(targets(results)))
    for result in results:
        if result.profile:
            print()
            print("\n".join(result.profile))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
