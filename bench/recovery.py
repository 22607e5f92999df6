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

detection = the first sign that the fault was noticed (herd: its own line; torchrun: any
failure or restart line of a surviving node, or its exit); resumed = the first progress line
after "resumed from". Both are capped at --cap seconds ("> cap s").

Targets: frozen rank anywhere detected <= 60 s; node loss detected <= 15 s; node lost to the
first resumed step <= 20 s; worker killed to the first resumed step no slower than torchrun's
own restart (ratio herd/torchrun <= 1.0).

The false-alarm half runs one healthy job (tests/integration/scripts/phases.py) at default
settings: 150 s of silent computing on every rank (herd is stopped for 30 s in the middle of
it), 150 s of silent writing on rank 0 while rank 1 waits in a barrier, then Ctrl-C with a
20-s SIGTERM handler on every rank (--grace 40). Every "hung", "stopped answering", "cutting
it off", "lost contact" or stop by the agents is a false alarm (target 0). Needs root.

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
)
HERD_ONLY = ("hang", "hang-early", "node-lost-spare", "grow-back")
DETECTION_ONLY = ("hang", "hang-early")
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
    with Testbed(4) as bed, tempfile.TemporaryDirectory(prefix="herd-bench-") as scratch:
        for run in range(args.runs):
            for fault in faults:
                runners = ["herd"]
                if fault not in HERD_ONLY and not args.no_torchrun:
                    runners.append("torchrun")
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
