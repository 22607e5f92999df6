"""Recovery: seconds from a fault to its detection and to the first training step after it, and
false alarms on a healthy job that is busy, quiet, slow to stop and briefly without launcher.

Faults, on 3 testbed nodes (one worker each; node4 is only ever a hot spare) running
tests/integration/scripts/slow_minimal.py (the Trainer, a snapshot every 20 steps), injected
after the snapshot of step 40, each run --runs times (medians reported). herd runs
`herd launch --max-restarts 1 --min-nodes 2` at default settings; torchrun runs the tutorial
recipe by hand on every node over ssh in its elastic form (--nnodes=2:3 --max-restarts=1),
the closest it has to --min-nodes:

  worker-killed   SIGKILL of the worker on node2
  node-lost       node3's link down
  rdzv-host-lost  node1's link down (the rendezvous host)
  hang            SIGSTOP of the worker on node2 mid-run (herd only: torchrun has no watch)
  hang-early      SIGSTOP of rank 1 before its first collective (herd only; phases.py)
  node-lost-spare node3's link down with node4 a hot spare (herd only)
  grow-back       node3's link down, then back once the job goes on with 2 nodes: seconds from
                  the link's return to the first step of the grown job (herd only)

Faults that are judged by the hang watch and the agents (herd only; each a detection and
whether herd named the right rank or node):

  phase-deadlock  rank 1 deadlocks inside phase("saving") while the others wait in a barrier,
                  with --hang-timeout 60 (waits.py): seconds from its last line to the verdict
  never-exits     rank 1 never exits (a non-daemon thread) after the others finished
                  (waits.py): seconds from its last line to "finished, but ... never exited"
  torchrun-frozen node3's torchrun stopped (SIGSTOP) at its start, before it starts a worker (its
                  interpreter stops itself): seconds from the job's banner to the verdict
  link-cut        node3's link cut for up to 4 minutes while every rank prints 1000 lines a
                  second (chatty.py: the link's buffers fill): seconds until node3's workers
                  are gone, with launcher_silence 90 s (the default) and --grace 3

detection = the first sign that the fault was noticed (herd: its own line; torchrun: any
failure or restart line of a surviving node, or its exit); resumed = the first progress line
after "resumed from". Both are capped at --cap seconds ("> cap s").

Targets: frozen rank anywhere detected <= 60 s; a deadlock inside a phase with --hang-timeout
60 <= 150 s; a rank that never exits <= 180 s; a frozen torchrun <= 60 s (as a frozen rank);
a cut-off node's workers gone <= launcher_silence + grace (93 s); node loss detected <= 15 s;
node lost to the first resumed step <= 20 s; worker killed to the first resumed step no slower
than torchrun's own restart (ratio herd/torchrun <= 1.0).

The false-alarm half runs one healthy job (tests/integration/scripts/phases.py) at default
settings: 150 s of silent computing on every rank (herd is stopped for 30 s in the middle of
it), 150 s of silent writing on rank 0 while rank 1 waits in a barrier, then Ctrl-C with a
20-s SIGTERM handler on every rank (--grace 40). Every "hung", "stopped answering", "cutting
it off", "lost contact" or stop by the agents is a false alarm (target 0). With the fault
"waits" (herd only), one more healthy job per run waits on the world outside the job, one wait
after another (waits.py, default settings): rank 0 downloads for 45 s from a server on its
node's loopback that sends a byte a second while the others wait in a barrier; rank 1 sleeps
30 s (a retry's backoff) while the others wait in an all-reduce; rank 2 is blocked 40 s on a
file lock another process holds; rank 1 is in state D for 40 s (as on a hung mount). Each
wait's row counts the false alarms said during it (target 0). Needs root.

    python bench/recovery.py [--runs 3] [--cap 180] [--faults worker-killed,...] [--no-alarms]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.launch import start_by_hand  # noqa: E402
from tests.testbed import Testbed  # noqa: E402

SCRIPTS = ROOT / "tests" / "integration" / "scripts"
ARGS = ["--max-steps", "100000", "--snapshot-every", "20", "--batch-size", "16"]
HERD_NOTICES = r"failed; stopping the other nodes|stopped answering|the job is hung|lost contact"
TORCHRUN_NOTICES = (
    r"Traceback|Error|error:|failed|Restarting|restart|Signals\.|exitcode|Connection reset|"
    r"DistNetworkError|timed out"
)
FALSE_ALARMS = (
    r"the job is hung|stopped answering|cutting it off|lost contact|heard nothing from this "
    r"launcher"
)
RESUMED_STEP = r"\bstep \d+"
FAULTS = (
    "worker-killed",
    "node-lost",
    "rdzv-host-lost",
    "hang",
    "hang-early",
    "node-lost-spare",
    "grow-back",
    "phase-deadlock",
    "never-exits",
    "torchrun-frozen",
    "link-cut",
    "waits",
)
WATCHED = ("phase-deadlock", "never-exits", "torchrun-frozen", "link-cut")
HERD_ONLY = ("hang", "hang-early", "node-lost-spare", "grow-back", *WATCHED, "waits")
DETECTION_ONLY = ("hang", "hang-early", *WATCHED)
# The waits of the "waits" fault: (name in waits.py's WAIT lines, row, its option and seconds).
WAITS = (
    ("download", "rank 0 downloads 45 s (others in a barrier)", "--download", "45"),
    ("backoff", "rank 1 backoff sleep 30 s", "--backoff", "30"),
    ("lock", "rank 2 on a file lock 40 s", "--lock", "40"),
    ("disk", "rank 1 in state D 40 s", "--disk-wait", "40"),
)
# Seconds the link-cut node's workers may outlive the cut: launcher_silence (default) + grace.
LINK_CUT_LIMIT = 90 + 3
# What herd must say for each watched fault (the right rank or node named), and its target.
WATCHED_VERDICTS = {
    "phase-deadlock": (r"the job is hung: .*set by --hang-timeout.*rank 1 in phase 'saving'", 150),
    "never-exits": (r"the job finished, but node2 rank 1 never exited", 180),
    "torchrun-frozen": (r"the job is hung: node3: torchrun stopped", 60),
    "link-cut": (r"node3 stopped answering", LINK_CUT_LIMIT),
}
JOB_NODES = ("node1", "node2", "node3")


class Lines:
    """Every line of some processes' output, with the time it was read."""

    def __init__(self, processes: list[subprocess.Popen[str]]) -> None:
        self.lines: list[tuple[float, int, str]] = []
        self.lock = threading.Lock()
        self.processes = processes
        for index, process in enumerate(processes):
            threading.Thread(target=self._read, args=(index, process), daemon=True).start()

    def _read(self, index: int, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with self.lock:
                self.lines.append((time.monotonic(), index, line.rstrip()))

    def first(self, pattern: str, after: float, skip: frozenset[int] = frozenset()) -> float | None:
        """When a line matching ``pattern`` first came, after ``after``, from processes not in
        ``skip``."""
        regex = re.compile(pattern)
        with self.lock:
            for when, index, line in self.lines:
                if when >= after and index not in skip and regex.search(line):
                    return when
        return None

    def matching(self, pattern: str) -> list[str]:
        regex = re.compile(pattern)
        with self.lock:
            return [line for _, _, line in self.lines if regex.search(line)]

    def write_trace(self, path: Path, injected: float) -> None:
        """Every line with its seconds since the fault (where a recovery spent its time)."""
        with self.lock:
            path.write_text(
                "".join(
                    f"{when - injected:+8.2f} [{index}] {line}\n"
                    for when, index, line in self.lines
                )
            )

    def first_after_resume(self, after: float) -> float | None:
        with self.lock:
            resumed = next(
                (t for t, _, line in self.lines if t >= after and "resumed from" in line), None
            )
        return None if resumed is None else self.first(RESUMED_STEP, resumed)


def tagged_pid(bed: Testbed, tag: tuple[str, str], node: str, rank_env: str) -> int:
    """The worker of ``node`` among processes carrying the env pair ``tag``."""
    for pid in bed.processes_with_env(*tag):
        try:
            env = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        on_node = tag[0] == "TORCHELASTIC_RUN_ID" or f"HERD_NODE={node}".encode() in env
        if on_node and rank_env.encode() in env and b"LOCAL_RANK=0" in env:
            return pid
    raise RuntimeError(f"no worker {rank_env} on {node}")


def herd_process(
    bed: Testbed,
    work: Path,
    home: Path,
    argv_tail: list[str],
    spare: bool = False,
) -> subprocess.Popen[str]:
    """herd on the job's 3 nodes, one worker each (as torchrun by hand), with node4 a hot
    spare when ``spare``."""
    nodes: list[str | dict[str, object]] = [{"host": name, "nproc": 1} for name in JOB_NODES]
    if spare:
        nodes.append({"host": "node4", "nproc": 1, "spare": True})
    return launch_on(bed, work, home, nodes, argv_tail)


def launch_on(
    bed: Testbed,
    work: Path,
    home: Path,
    nodes: list[str | dict[str, object]],
    argv_tail: list[str],
) -> subprocess.Popen[str]:
    """`herd launch` on ``nodes`` from a cluster file written in ``work``, output merged."""
    cluster = bed.write_cluster_file(
        work / "herd.toml",
        nodes=nodes,
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
    )
    argv = [sys.executable, "-m", "torchherd", "launch", "-c", str(cluster), *argv_tail]
    return subprocess.Popen(
        argv,
        cwd=SCRIPTS,
        env=dict(os.environ, HERD_HOME=str(home), PYTHONUNBUFFERED="1"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def start_herd(bed: Testbed, work: Path, home: Path, run_dir: Path, spare: bool = False) -> Lines:
    tail = ["--grace", "3", "--max-restarts", "1", "--min-nodes", "2", "slow_minimal.py", *ARGS]
    return Lines([herd_process(bed, work, home, [*tail, "--run-dir", str(run_dir)], spare)])


def start_torchrun(bed: Testbed, run_dir: Path, run_id: str, port: int) -> Lines:
    script = f"slow_minimal.py {' '.join(ARGS)} --run-dir {run_dir}"
    processes = start_by_hand(
        bed,
        len(JOB_NODES),
        1,
        SCRIPTS,
        port,
        run_id,
        script,
        torchrun_args="--max-restarts=1",
        nnodes=f"2:{len(JOB_NODES)}",
        with_stderr=True,
    )
    return Lines(processes)


def cleanup(
    bed: Testbed, lines: Lines, tags: list[tuple[str, str]], stopped: list[int], cut: list[str]
) -> None:
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    for process in lines.processes:  # Ctrl-C, as a user would
        try:
            os.killpg(process.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    for node in cut:
        bed.heal(node)
    end = time.monotonic() + 60
    for process in lines.processes:
        try:
            process.wait(max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
    for key, value in tags:  # whatever a runner left behind, by its tag
        for pid in bed.processes_with_env(key, value):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def measure(
    bed: Testbed, fault: str, runner: str, cap: float, scratch: Path, trace: Path | None = None
) -> tuple[float | None, float | None]:
    """(seconds to detection, seconds to the first resumed step); None past the cap. With
    ``trace``, the run's output is written there, each line timed from the fault."""
    work = Path(tempfile.mkdtemp(dir=scratch))
    run_dir, home = work / "run", work / "home"
    run_id = f"bench{os.getpid()}{int(time.time())}"
    if fault == "hang-early":
        tail = ["--grace", "3", "phases.py", "--pause-before-init", "5"]
        lines = Lines([herd_process(bed, work, home, tail)])
    elif runner == "herd":
        lines = start_herd(bed, work, home, run_dir, spare=fault == "node-lost-spare")
    else:
        lines = start_torchrun(bed, run_dir, run_id, 29300 + int(time.time()) % 500)
    stopped: list[int] = []
    cut: list[str] = []
    tags = [("TORCHELASTIC_RUN_ID", run_id)]
    injected = time.monotonic()
    try:
        deadline = time.monotonic() + 300
        if fault == "hang-early":
            while not lines.matching(r"STARTED rank=1 pid="):
                if time.monotonic() > deadline:
                    raise RuntimeError("hang-early: rank 1 never started")
                time.sleep(0.05)
        else:
            while not (run_dir / "snapshots" / "step-40").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{runner}: no snapshot in time")
                time.sleep(0.1)
        if (home / "jobs").is_dir():
            tags += [("HERD_JOB_ID", job.name) for job in (home / "jobs").iterdir()]
        tag = tags[-1] if runner == "herd" else tags[0]
        injected = time.monotonic()
        skip: frozenset[int] = frozenset()
        if fault == "worker-killed":
            os.kill(tagged_pid(bed, tag, "node2", "RANK=1"), signal.SIGKILL)
        elif fault == "hang":
            victim = tagged_pid(bed, tag, "node2", "RANK=1")
            os.kill(victim, signal.SIGSTOP)
            stopped.append(victim)
        elif fault == "hang-early":
            found = re.search(r"pid=(\d+)", lines.matching(r"STARTED rank=1 pid=")[0])
            assert found is not None
            os.kill(int(found.group(1)), signal.SIGSTOP)
            stopped.append(int(found.group(1)))
        else:
            node = "node1" if fault == "rdzv-host-lost" else "node3"
            bed.partition(node)
            cut.append(node)
            # A cut-off node's own lines do not count as the survivors noticing (torchrun by
            # hand: one output per node; herd has one launcher output, never on a node).
            if runner == "torchrun":
                skip = frozenset({bed.nodes.index(bed.node(node))})
        pattern = HERD_NOTICES if runner == "herd" else TORCHRUN_NOTICES
        detected = resumed = None
        if fault == "grow-back":
            return grow_back(bed, lines, injected, cut, cap)
        while time.monotonic() - injected < cap:
            if detected is None:
                found_at = lines.first(pattern, injected, skip)
                exited = [i for i, p in enumerate(lines.processes) if p.poll() is not None]
                if found_at is None and any(i not in skip for i in exited):
                    found_at = time.monotonic()
                detected = None if found_at is None else found_at - injected
            if fault in DETECTION_ONLY:
                if detected is not None:
                    break
            else:
                found_at = lines.first_after_resume(injected)
                if found_at is not None:
                    resumed = found_at - injected
                    break
            if all(p.poll() is not None for p in lines.processes):
                break
            time.sleep(0.2)
        return detected, resumed
    finally:
        cleanup(bed, lines, tags, stopped, cut)
        if trace is not None:
            lines.write_trace(trace, injected)


def herd_on(
    bed: Testbed, work: Path, home: Path, tail: list[str], python: dict[str, str] | None = None
) -> Lines:
    """herd on the job's 3 nodes at default settings (``python``: a node's own interpreter)."""
    nodes: list[str | dict[str, object]] = [
        {"host": n, "nproc": 1, **({"python": python[n]} if python and n in python else {})}
        for n in JOB_NODES
    ]
    return Lines([launch_on(bed, work, home, nodes, tail)])


def wait_line(lines: Lines, pattern: str, timeout: float) -> float:
    """When a line matching ``pattern`` came (waiting up to ``timeout`` s for it)."""
    deadline = time.monotonic() + timeout
    while True:
        found = lines.first(pattern, 0.0)
        if found is not None:
            return found
        if time.monotonic() > deadline or all(p.poll() is not None for p in lines.processes):
            raise RuntimeError(f"{pattern!r} never came")
        time.sleep(0.1)


def workers_on(bed: Testbed, job: str, node: str) -> list[int]:
    found = []
    for pid in bed.processes_with_env("HERD_JOB_ID", job):
        try:
            env = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if f"HERD_NODE={node}".encode() in env and any(e.startswith(b"RANK=") for e in env):
            found.append(pid)
    return found


def measure_watched(
    bed: Testbed, fault: str, cap: float, scratch: Path, trace: Path | None = None
) -> tuple[float | None, bool]:
    """(seconds from the fault to herd's verdict, or to a cut-off node's workers being gone;
    whether herd named the right rank or node) for a WATCHED fault; None past the cap."""
    work = Path(tempfile.mkdtemp(dir=scratch))
    home = work / "home"
    pattern, _ = WATCHED_VERDICTS[fault]
    python = None
    if fault == "torchrun-frozen":
        frozen = work / "frozen-python"
        frozen.write_text(
            "#!/bin/sh\n"
            'case " $* " in *" torchherd.agent.elastic "*) kill -STOP $$ ;; esac\n'
            f'exec {sys.executable} "$@"\n'
        )
        frozen.chmod(0o755)
        python = {"node3": str(frozen)}
        tail = ["waits.py"]
    elif fault == "phase-deadlock":
        tail = ["--hang-timeout", "60", "waits.py", "--deadlock-in-phase"]
    elif fault == "never-exits":
        tail = ["waits.py", "--never-exit"]
    else:
        tail = ["--grace", "3", "chatty.py", "--seconds", "900", "--rate", "1000"]
    lines = herd_on(bed, work, home, tail, python)
    tags: list[tuple[str, str]] = []
    cut: list[str] = []
    injected = time.monotonic()
    try:
        start = {
            "torchrun-frozen": r"world size 3",
            "phase-deadlock": r"STEPPING rank=1",
            "never-exits": r"DONE rank=1",
            "link-cut": r"rank 2 line \d+",
        }[fault]
        injected = wait_line(lines, start, 300)
        tags = [("HERD_JOB_ID", job.name) for job in (home / "jobs").iterdir()]
        if fault == "link-cut":
            time.sleep(5)  # a few MB in flight
            bed.partition("node3")
            cut.append("node3")
            injected = time.monotonic()
            while time.monotonic() - injected < min(cap, 240):
                if not workers_on(bed, tags[0][1], "node3"):
                    return time.monotonic() - injected, lines.first(pattern, 0.0) is not None
                time.sleep(0.5)
            return None, lines.first(pattern, 0.0) is not None
        while time.monotonic() - injected < cap:
            found = lines.first(r"the job is hung|never exited|stopped answering", injected)
            if found is not None:
                return found - injected, lines.first(pattern, 0.0) is not None
            if all(p.poll() is not None for p in lines.processes):
                break
            time.sleep(0.2)
        return None, False
    finally:
        cleanup(bed, lines, tags, [], cut)
        if trace is not None:
            lines.write_trace(trace, injected)


def waits_alarms(
    bed: Testbed, scratch: Path, trace: Path | None = None
) -> dict[str, tuple[int, bool]]:
    """One healthy job that waits on the world outside it, one wait after another (WAITS):
    for each wait, (false alarms said during it, whether every rank got past it)."""
    work = Path(tempfile.mkdtemp(dir=scratch))
    home = work / "home"
    tail = ["waits.py", *[arg for _, _, option, value in WAITS for arg in (option, value)]]
    lines = herd_on(bed, work, home, tail)
    tags: list[tuple[str, str]] = []
    try:
        deadline = time.monotonic() + 600
        while all(p.poll() is None for p in lines.processes) and time.monotonic() < deadline:
            if not tags and (home / "jobs").is_dir():
                tags = [("HERD_JOB_ID", job.name) for job in (home / "jobs").iterdir()]
            time.sleep(0.5)
    finally:
        cleanup(bed, lines, tags, [], [])
        if trace is not None:
            lines.write_trace(trace, 0.0)
    found: dict[str, tuple[int, bool]] = {}
    with lines.lock:
        said = [(t, line) for t, _, line in lines.lines]
    alarm = re.compile(FALSE_ALARMS)
    for name, _, _, _ in WAITS:
        began = next((t for t, line in said if line.endswith(f"WAIT {name}")), None)
        ended = next((t for t, line in said if line.endswith(f"WAITED {name}")), None)
        if began is None:
            found[name] = (0, False)
            continue
        during = [
            line
            for t, line in said
            if t >= began and (ended is None or t <= ended) and alarm.search(line)
        ]
        found[name] = (len(during), ended is not None)
    return found


def grow_back(
    bed: Testbed, lines: Lines, cut_at: float, cut: list[str], cap: float
) -> tuple[float | None, float | None]:
    """(seconds from node3's cut to the job going on without it, seconds from node3's return to
    the first step of the job grown back to 3 nodes)."""
    deadline = cut_at + cap
    while lines.first_after_resume(cut_at) is None:
        if time.monotonic() > deadline:
            return None, None
        time.sleep(0.2)
    shrunk = (lines.first_after_resume(cut_at) or cut_at) - cut_at
    bed.heal(cut.pop())
    healed = time.monotonic()
    while time.monotonic() - healed < cap:
        grown = lines.first(r"world size 3 \(was 2\)", healed)
        if grown is not None:
            resumed = lines.first_after_resume(grown)
            if resumed is not None:
                return shrunk, resumed - healed
        time.sleep(0.2)
    return shrunk, None


def false_alarms(bed: Testbed, scratch: Path) -> tuple[int, list[str], int | None]:
    """Run the healthy job of the module docstring: (false alarms, their lines, exit code)."""
    work = Path(tempfile.mkdtemp(dir=scratch))
    home = work / "home"
    tail = [
        "--grace",
        "40",
        "phases.py",
        "--steps",
        "50",
        "--compute",
        "150",
        "--save",
        "150",
        "--linger",
        "--sigterm-delay",
        "20",
    ]
    process = herd_process(bed, work, home, tail)
    lines = Lines([process])
    tags: list[tuple[str, str]] = []
    try:
        deadline = time.monotonic() + 300
        while len(lines.matching(r"STEPPING rank=")) < len(bed.nodes):
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the healthy job did not start")
            time.sleep(0.2)
        tags = [("HERD_JOB_ID", job.name) for job in (home / "jobs").iterdir()]
        time.sleep(60)  # in the silent computation
        process.send_signal(signal.SIGSTOP)  # herd away for 30 s (a Ctrl-Z, a paused VM)
        time.sleep(30)
        process.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 600
        while len(lines.matching(r"LINGERING rank=")) < len(bed.nodes):
            if time.monotonic() > deadline or process.poll() is not None:
                break
            time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=180)
    finally:
        cleanup(bed, lines, tags, [], [])
    alarms = lines.matching(FALSE_ALARMS)
    return len(alarms), alarms, code


def shown(seconds: float | None, cap: float) -> str:
    return f"> {cap:.0f} s" if seconds is None else f"{seconds:.1f} s"


def median(values: list[float | None]) -> float | None:
    """The median, a run past the cap counting as infinitely slow (None if most were)."""
    ranked = sorted(float("inf") if v is None else v for v in values)
    middle = statistics.median(ranked) if ranked else float("inf")
    return None if middle == float("inf") else middle


def verdict(met: bool) -> str:
    return "met" if met else "NOT MET"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cap", type=float, default=180)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--no-torchrun", action="store_true", help="measure herd only")
    parser.add_argument("--no-alarms", action="store_true", help="skip the false-alarm half")
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write each run's output here, timed from the fault",
    )
    args = parser.parse_args()
    say: Callable[[str], None] = lambda text: print(text, flush=True)  # noqa: E731
    faults = [f for f in args.faults.split(",") if f]
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str], list[tuple[float | None, float | None]]] = {}
    alarms: tuple[int, list[str], int | None] | None = None
    waited: dict[str, list[tuple[int, bool]]] = {}
    """Per wait of the "waits" job: (false alarms, got past it) per run."""
    names: dict[str, list[bool]] = {}
    """Per watched fault: whether herd named the right rank or node, per run."""
    with Testbed(4) as bed, tempfile.TemporaryDirectory(prefix="herd-bench-") as scratch:
        for run in range(args.runs):
            for fault in faults:
                runners = ["herd"]
                if fault not in HERD_ONLY and not args.no_torchrun:
                    runners.append("torchrun")
                if fault in WATCHED or fault == "waits":
                    trace = None
                    if args.trace is not None:
                        trace = args.trace / f"{fault}-herd-run{run + 1}.txt"
                    try:
                        if fault == "waits":
                            seen = waits_alarms(bed, Path(scratch), trace)
                        else:
                            watched = measure_watched(bed, fault, args.cap, Path(scratch), trace)
                    except RuntimeError as exc:  # the job never reached the fault: say so
                        say(f"run {run + 1}: {fault} (herd): not measured: {exc}")
                        continue
                    if fault == "waits":
                        for name, (count, passed) in seen.items():
                            waited.setdefault(name, []).append((count, passed))
                            say(
                                f"run {run + 1}: waits ({name}): {count} false alarm(s)"
                                f"{'' if passed else ', never got past it'}"
                            )
                        continue
                    seconds, named = watched
                    results.setdefault((fault, "herd"), []).append((seconds, None))
                    names.setdefault(fault, []).append(named)
                    say(
                        f"run {run + 1}: {fault} (herd): detected {shown(seconds, args.cap)}, "
                        f"{'named' if named else 'NOT named'}"
                    )
                    continue
                for runner in runners:
                    trace = None
                    if args.trace is not None:
                        trace = args.trace / f"{fault}-{runner}-run{run + 1}.txt"
                    found = measure(bed, fault, runner, args.cap, Path(scratch), trace)
                    results.setdefault((fault, runner), []).append(found)
                    say(
                        f"run {run + 1}: {fault} ({runner}): detected {shown(found[0], args.cap)}"
                        f", first resumed step {shown(found[1], args.cap)}"
                    )
        if not args.no_alarms:
            alarms = false_alarms(bed, Path(scratch))
    say(f"\nmedians of {args.runs} run(s)")
    say(f"{'fault (runner)':<30} {'detection':>10} {'first resumed step':>20}")
    medians: dict[tuple[str, str], tuple[float | None, float | None]] = {}
    for (fault, runner), found in results.items():
        medians[(fault, runner)] = (median([d for d, _ in found]), median([r for _, r in found]))
        detected, resumed = medians[(fault, runner)]
        resumed_text = "-" if fault in DETECTION_ONLY else shown(resumed, args.cap)
        say(f"{fault + ' (' + runner + ')':<30} {shown(detected, args.cap):>10} {resumed_text:>20}")
    for name, row, _, _ in WAITS:
        if name in waited:
            count = sum(c for c, _ in waited[name])
            passed = sum(1 for _, p in waited[name] if p)
            text = f"{count} alarm(s), past it in {passed} of {len(waited[name])} run(s)"
            say(f"{'waits: ' + row:<48} {text}")
    say("\ntargets")
    for fault in ("hang", "hang-early"):
        if (fault, "herd") in medians:
            detected = medians[(fault, "herd")][0]
            say(
                f"  frozen rank ({fault}) detected <= 60 s: {shown(detected, args.cap)} "
                f"{verdict(detected is not None and detected <= 60)}"
            )
    if ("node-lost", "herd") in medians:
        detected, resumed = medians[("node-lost", "herd")]
        say(
            f"  node loss detected <= 15 s: {shown(detected, args.cap)} "
            f"{verdict(detected is not None and detected <= 15)}"
        )
        say(
            f"  node lost to first resumed step <= 20 s: {shown(resumed, args.cap)} "
            f"{verdict(resumed is not None and resumed <= 20)}"
        )
    for fault in ("worker-killed", "node-lost", "rdzv-host-lost"):
        if (fault, "herd") in medians and (fault, "torchrun") in medians:
            ours, theirs = medians[(fault, "herd")][1], medians[(fault, "torchrun")][1]
            if ours is None:
                ratio_text, met = "herd did not resume", False
            elif theirs is None:
                ratio_text, met = "torchrun did not resume (ratio < 1)", True
            else:
                ratio_text, met = (
                    f"{ours / theirs:.2f} ({ours:.1f} / {theirs:.1f} s)",
                    ours <= theirs,
                )
            target = " (target <= 1.0)" if fault == "worker-killed" else ""
            say(
                f"  {fault}: herd/torchrun to first resumed step {ratio_text}{target}"
                + (f" {verdict(met)}" if target else "")
            )
    for fault in WATCHED:
        if (fault, "herd") in medians:
            detected = medians[(fault, "herd")][0]
            _, target = WATCHED_VERDICTS[fault]
            runs = names.get(fault, [])
            met = detected is not None and detected <= target and all(runs)
            say(
                f"  {fault} detected <= {target} s, named: {shown(detected, args.cap)}, named "
                f"in {sum(runs)} of {len(runs)} run(s) {verdict(met)}"
            )
    for name, row, _, _ in WAITS:
        if name in waited:
            count = sum(c for c, _ in waited[name])
            met = count == 0 and all(p for _, p in waited[name])
            say(f"  waits: {row}: false alarms (target 0): {count} {verdict(met)}")
    if alarms is not None:
        count, seen, code = alarms
        say(
            f"  false alarms on the healthy job (target 0): {count} {verdict(count == 0)}"
            f" (herd exited {code})"
        )
        for line in seen:
            say(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
