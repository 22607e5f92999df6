"""Slow ranks: seconds to name a node slowed for real, and false alarms on a balanced job.

On 2 testbed nodes (one worker each, one core each: OMP_NUM_THREADS=1), herd runs
tests/integration/scripts/heavy.py, a compute-bound data-parallel job: by default the Trainer
of torchherd.train (which reports each rank's compute per step), with --plain a hand-written
DDP loop (herd then looks at the ranks). Once the job trains, node2's worker is held to 1/s of
a CPU by a real cgroup quota (s = 1.5 and 3: the slowdowns asked for) and the time until herd
names "node2 rank 1" is measured, with the ratio herd reports. A balanced run of --balanced
minutes counts every slow rank herd names (false alarms, target 0).

Targets: a slowed node named within 120 s at 1.5x and 3x; 0 false alarms. Needs root.

    python bench/straggler.py [--slowdowns 1.5,3] [--balanced 10] [--plain] [--cap 240]
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
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.testbed import Testbed  # noqa: E402

SCRIPTS = ROOT / "tests" / "integration" / "scripts"
NAMED = re.compile(r"herd: slow rank: (\S+ rank \d+ .*)")


class Job:
    """`herd launch heavy.py` on the testbed, its lines read as they come."""

    def __init__(self, bed: Testbed, work: Path, plain: bool) -> None:
        home = work / "home"
        cluster = bed.write_cluster_file(
            work / "herd.toml",
            nodes=[{"host": n.name, "nproc": 1} for n in bed.nodes],
            workdir=str(SCRIPTS),
            env={"HERD_HOME": str(home), "OMP_NUM_THREADS": "1"},
        )
        script = ["heavy.py", "--plain"] if plain else ["heavy.py", "--run-dir", str(work / "run")]
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

    def named(self, after: float = 0.0) -> list[tuple[float, str]]:
        return [
            (t, m.group(1))
            for t, line in list(self.lines)
            if (m := NAMED.search(line)) and t >= after
        ]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Quota:
    """A CPU cgroup holding one process to a share of a CPU."""

    def __init__(self, pid: int, share: float) -> None:
        name = f"herd-bench-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        v1 = Path("/sys/fs/cgroup/cpu")
        self.path = (v1 if (v1 / "cpu.cfs_quota_us").exists() else Path("/sys/fs/cgroup")) / name
        self.path.mkdir()
        if (self.path / "cpu.cfs_quota_us").exists():
            (self.path / "cpu.cfs_period_us").write_text("100000")
            (self.path / "cpu.cfs_quota_us").write_text(str(int(share * 100000)))
        else:
            (self.path / "cpu.max").write_text(f"{int(share * 100000)} 100000")
        (self.path / "cgroup.procs").write_text(str(pid))

    def release(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.path.parent / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        self.path.rmdir()


def time_to_name(
    bed: Testbed, scratch: Path, slowdown: float, plain: bool, cap: float
) -> tuple[float | None, str]:
    job = Job(bed, Path(tempfile.mkdtemp(dir=scratch)), plain)
    quota = None
    try:
        victim = job.workers(2)[1]
        time.sleep(30)  # the job's rhythm settles
        started = time.monotonic()
        quota = Quota(victim, 1 / slowdown)
        while time.monotonic() - started < cap:
            named = job.named(started)
            if named:
                return named[0][0] - started, named[0][1]
            time.sleep(0.5)
        return None, ""
    finally:
        if quota is not None:
            quota.release()
        job.stop()


def false_alarms(bed: Testbed, scratch: Path, minutes: float, plain: bool) -> list[str]:
    job = Job(bed, Path(tempfile.mkdtemp(dir=scratch)), plain)
    try:
        job.workers(2)
        time.sleep(minutes * 60)
        return [line for _, line in job.named()]
    finally:
        job.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slowdowns", default="1.5,3")
    parser.add_argument("--balanced", type=float, default=10.0, help="minutes of balanced run")
    parser.add_argument("--plain", action="store_true", help="a job without torchherd.train")
    parser.add_argument("--cap", type=float, default=240.0)
    args = parser.parse_args()
    rows = []
    with Testbed(2) as bed, tempfile.TemporaryDirectory(prefix="herd-bench-") as scratch:
        for text in args.slowdowns.split(","):
            slowdown = float(text)
            seconds, line = time_to_name(bed, Path(scratch), slowdown, args.plain, args.cap)
            rows.append((slowdown, seconds, line))
            shown = "not named" if seconds is None else f"{seconds:.0f} s"
            print(f"{slowdown:g}x slower: named after {shown}: {line}", flush=True)
        alarms = (
            false_alarms(bed, Path(scratch), args.balanced, args.plain) if args.balanced else []
        )
    kind = "hand-written DDP (looks)" if args.plain else "torchherd.train (compute times)"
    print(f"\nslow-rank watch, {kind}")
    print(f"{'slowdown':>9}  {'time to name':>12}  verdict (target <= 120 s)")
    for slowdown, seconds, _ in rows:
        shown = "> cap" if seconds is None else f"{seconds:.0f} s"
        met = seconds is not None and seconds <= 120
        print(f"{slowdown:>8g}x  {shown:>12}  {'met' if met else 'NOT MET'}")
    if args.balanced:
        verdict = "met" if not alarms else "NOT MET"
        print(
            f"false alarms over {args.balanced:g} min of a balanced job: {len(alarms)} "
            f"(target 0) {verdict}"
        )
        for line in alarms:
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
