"""Slow ranks: seconds to name a node slowed for real, the cause herd gives, and false names on
a balanced job per node-hour.

On 2 testbed nodes (one worker each, OMP_NUM_THREADS=1, 512 samples a step), herd runs
tests/integration/scripts/heavy.py, a compute-bound data-parallel job: by default the Trainer
of torchherd.train (which reports each rank's wait on the others per step), with --plain a
hand-written DDP loop (herd reads DDP's own timing of each iteration). Once the job trains, one
node's worker is slowed s times by each cause in turn, the victims alternating between the
nodes (herd names a rank again only after another one), with RECOVER seconds of calm between
rows:

    quota     a real cgroup CPU quota on the worker's threads of 1/s of the CPU it used
    busy      a busy process on the worker's node that shares its CPU cgroup and its CPU,
              niced so that its weight is s - 1 times the worker's
    stop      SIGSTOP and SIGCONT in turn, every second: stopped 1 - 1/s of the time
    loader    the worker's data-loader worker takes s times the job's step time a batch
              (heavy.py --loader-control; the Trainer only: a plain loop has no loader)

For each row: the seconds until herd names the slowed rank (or "not named" within --cap), the
ratio herd reports, and the cause: right (the quota; the competing process by pid), unknown
(no cause given) or WRONG (any other). Then a balanced run of --balanced minutes on
--balanced-nodes nodes counts every rank herd names: false names per node-hour.

Targets: 1.2x named within 120 s, 1.1x within 300 s, causes never wrong, 0 false names in a
node-hour. Needs root.

    python bench/straggler.py [--slowdowns 1.1,1.2,1.5,3] [--causes quota,busy,stop,loader]
                              [--balanced 30] [--balanced-nodes 2] [--plain] [--cap 300]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.slowdowns import (  # noqa: E402
    Busy,
    Quota,
    SlowLoader,
    StopAndGo,
    cpu_share,
    step_seconds,
)
from tests.testbed import Testbed  # noqa: E402

SCRIPTS = ROOT / "tests" / "integration" / "scripts"
NAMED = re.compile(r"herd: slow rank: ((\S+) rank (\d+) .*)")
# Seconds of calm after a row, so the watch's window holds no earlier slowness.
RECOVER = 45.0


class Job:
    """`herd launch heavy.py` on the testbed, its lines read as they come."""

    def __init__(self, bed: Testbed, work: Path, plain: bool, nodes: int = 2) -> None:
        home = work / "home"
        cluster = bed.write_cluster_file(
            work / "herd.toml",
            nodes=[{"host": n.name, "nproc": 1} for n in bed.nodes[:nodes]],
            workdir=str(SCRIPTS),
            env={"HERD_HOME": str(home), "OMP_NUM_THREADS": "1"},
        )
        # The Trainer's batches come through a loader worker the loader cause can slow.
        self.loader_control = work / "loader.json"
        script = (
            ["heavy.py", "--plain"]
            if plain
            else ["heavy.py", "--run-dir", str(work / "run")]
            + ["--loader-control", str(self.loader_control)]
        )
        script += ["--batch-size", "512"]  # about 150 ms of work a step, 30 ms of all-reduce
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torchherd", "launch", "-c", str(cluster), *script],
            cwd=SCRIPTS,
            env=dict(os.environ, HERD_HOME=str(home), PYTHONUNBUFFERED="1"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def workers(self, count: int, timeout: float = 300) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            found = {}
            for _, line in list(self.lines):
                match = re.search(r"HEAVY rank=(\d+) pid=(\d+)", line)
                if match:
                    found[int(match.group(1))] = int(match.group(2))
            if len(found) >= count:
                return found
            time.sleep(0.2)
        raise RuntimeError("the job did not start:\n" + "\n".join(t for _, t in self.lines))

    def step_seconds(self) -> float:
        """The job's latest step time, from rank 0's progress line (the job's samples/s)."""
        return step_seconds([line for _, line in list(self.lines)], 2 * 512)

    def named(self, after: float = 0.0) -> list[tuple[float, re.Match[str]]]:
        return [(t, m) for t, line in list(self.lines) if (m := NAMED.search(line)) and t >= after]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


Harm = Quota | Busy | StopAndGo | SlowLoader


def harm_for(cause: str, job: Job, bed: Testbed, victim: int, pid: int, slowdown: float) -> Harm:
    if cause == "quota":
        return Quota(pid, cpu_share(pid) / slowdown)
    if cause == "busy":
        return Busy(bed, bed.nodes[victim].name, pid, slowdown)
    if cause == "stop":
        return StopAndGo(pid, slowdown)
    return SlowLoader(job.loader_control, victim, slowdown * job.step_seconds())


def verdict(line: str, cause: str, culprits: list[int]) -> str:
    """right, unknown or WRONG: the cause herd gave for a slowdown of a known cause."""
    if "(likely: " not in line:
        return "unknown"
    said = line.split("(likely: ", 1)[1]
    if cause == "quota":
        right = "CPU throttled by its cgroup" in said and "competing" not in said
    elif cause == "busy":
        right = any(f"(pid {pid}," in said for pid in culprits) and "throttled" not in said
    elif cause == "stop":
        right = "it was stopped" in said and "throttled" not in said
    else:
        right = "its data loader" in said and "stopped" not in said and "throttled" not in said
    return "right" if right else "WRONG"


def slow_rows(
    bed: Testbed, scratch: Path, slowdowns: list[float], causes: list[str], plain: bool, cap: float
) -> list[tuple[str, float, float | None, str, str]]:
    """(cause, slowdown, seconds to name or None, ratio said, verdict) per row, one job."""
    job = Job(bed, Path(tempfile.mkdtemp(dir=scratch)), plain)
    rows = []
    try:
        workers = job.workers(2)
        time.sleep(30)  # the job's rhythm settles
        victim = 1
        for cause in causes:
            for slowdown in slowdowns:
                node, pid = bed.nodes[victim].name, workers[victim]
                started = time.monotonic()
                harm = harm_for(cause, job, bed, victim, pid, slowdown)
                culprits = [p.pid for p in harm.processes] if isinstance(harm, Busy) else []
                seconds, ratio, judged = None, "", "-"
                try:
                    while time.monotonic() - started < cap:
                        named = job.named(started)
                        if named:
                            at, match = named[0]
                            if (match.group(2), int(match.group(3))) != (node, victim):
                                judged = f"WRONG RANK: {match.group(1)}"
                            else:
                                judged = verdict(match.group(1), cause, culprits)
                            seconds = at - started
                            found = re.search(r"is (\d+\.\d+)x", match.group(1))
                            ratio = found.group(1) if found else "?"
                            print(f"  {cause} {slowdown:g}x: {match.group(1)}", flush=True)
                            break
                        time.sleep(0.5)
                finally:
                    harm.release()
                rows.append((cause, slowdown, seconds, ratio, judged))
                shown = "not named" if seconds is None else f"named after {seconds:.0f} s"
                print(f"{cause} {slowdown:g}x slower: {shown} ({judged})", flush=True)
                if seconds is not None:
                    victim = 1 - victim  # the same rank is named again only after another
                time.sleep(RECOVER)
    finally:
        job.stop()
    return rows


def false_names(bed: Testbed, scratch: Path, minutes: float, plain: bool, nodes: int) -> list[str]:
    job = Job(bed, Path(tempfile.mkdtemp(dir=scratch)), plain, nodes)
    try:
        job.workers(nodes)
        time.sleep(minutes * 60)
        return [m.group(1) for _, m in job.named()]
    finally:
        job.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slowdowns", default="1.1,1.2,1.5,3")
    parser.add_argument("--causes", default="quota,busy,stop,loader")
    parser.add_argument("--balanced", type=float, default=30.0, help="minutes of balanced run")
    parser.add_argument("--balanced-nodes", type=int, default=2, help="nodes of the balanced run")
    parser.add_argument("--plain", action="store_true", help="a job without torchherd.train")
    parser.add_argument("--cap", type=float, default=300.0)
    args = parser.parse_args()
    slowdowns = [float(s) for s in args.slowdowns.split(",") if s]
    causes = [c for c in args.causes.split(",") if c]
    unknown = set(causes) - {"quota", "busy", "stop", "loader"}
    if unknown or args.balanced_nodes < 2:
        parser.error(f"unknown causes {sorted(unknown)}" if unknown else "--balanced-nodes >= 2")
    if args.plain and "loader" in causes:
        causes.remove("loader")
        print("loader: left out (the plain loop has no data loader for herd to see)")
    nodes = max(2, args.balanced_nodes)
    with Testbed(nodes) as bed, tempfile.TemporaryDirectory(prefix="herd-bench-") as scratch:
        rows = (
            slow_rows(bed, Path(scratch), slowdowns, causes, args.plain, args.cap)
            if slowdowns
            else []
        )
        alarms = (
            false_names(bed, Path(scratch), args.balanced, args.plain, args.balanced_nodes)
            if args.balanced
            else []
        )
    kind = "hand-written DDP (DDP's timing)" if args.plain else "torchherd.train (waits)"
    print(f"\nslow-rank watch, {kind}, 2 nodes")
    print(
        f"{'cause':>6} {'slowdown':>9}  {'time to name':>12}  {'ratio said':>10}  cause    target"
    )
    for cause, slowdown, seconds, ratio, judged in rows:
        shown = "not named" if seconds is None else f"{seconds:.0f} s"
        target = 120 if slowdown >= 1.2 else 300
        met = seconds is not None and seconds <= target and judged != "WRONG"
        print(
            f"{cause:>6} {slowdown:>8g}x  {shown:>12}  {ratio:>10}  {judged:<8} "
            f"<= {target} s: {'met' if met else 'NOT MET'}"
        )
    if args.balanced:
        node_hours = args.balanced_nodes * args.balanced / 60
        rate = len(alarms) / node_hours
        print(
            f"false names on a balanced job: {len(alarms)} in {node_hours:.2f} node-hours "
            f"({rate:.1f} per node-hour; target 0): {'met' if not alarms else 'NOT MET'}"
        )
        for line in alarms:
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
