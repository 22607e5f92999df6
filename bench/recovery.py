"""Recovery: seconds from a fault to its detection and to the first training step after it.

For each fault, on 3 testbed nodes (one worker each) running tests/integration/scripts/
slow_minimal.py (the Trainer, a snapshot every 20 steps), once under `herd launch
--max-restarts 1 --min-nodes 2` and once under plain torchrun started by hand on every node over
ssh (the tutorial recipe, with its own --max-restarts 1), after the snapshot of step 40:

  worker-killed   SIGKILL of the worker on node2
  node-lost       node3's link down
  hang            SIGSTOP of the worker on node2 (herd: learned limit, and --hang-timeout 20)
  rdzv-host-lost  node1's link down (the rendezvous host)

detection = the first sign that the fault was noticed (herd: its own line; torchrun: any
failure or restart line of a surviving node, or its exit); resumed = the first progress line
after "resumed from". Both are capped at --cap seconds and printed as "> cap s". Targets for
herd: detection <= 15 s (node loss), <= 60 s (hang); worker killed to first resumed step
<= 15 s; rendezvous host lost to training on the survivors <= 60 s. Needs root.

    python bench/recovery.py [--cap 180] [--faults worker-killed,node-lost,...]
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
RESUMED_STEP = r"\bstep \d+"


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

    def first_after_resume(self, after: float) -> float | None:
        with self.lock:
            resumed = next(
                (t for t, _, line in self.lines if t >= after and "resumed from" in line), None
            )
        return None if resumed is None else self.first(RESUMED_STEP, resumed)


def worker_pid(bed: Testbed, tag: tuple[str, str], node: str, rank_env: str) -> int:
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


def start_herd(bed: Testbed, work: Path, home: Path, run_dir: Path, extra: list[str]) -> Lines:
    cluster = bed.write_cluster_file(
        work / "herd.toml",
        nodes=[{"host": n.name, "nproc": 1} for n in bed.nodes],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
    )
    argv = [sys.executable, "-m", "torchherd", "launch", "-c", str(cluster), "--grace", "3"]
    argv += ["--max-restarts", "1", "--min-nodes", "2", *extra, "slow_minimal.py", *ARGS]
    argv += ["--run-dir", str(run_dir)]
    process = subprocess.Popen(
        argv,
        cwd=SCRIPTS,
        env=dict(os.environ, HERD_HOME=str(home), PYTHONUNBUFFERED="1"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return Lines([process])


def start_torchrun(bed: Testbed, run_dir: Path, run_id: str, port: int) -> Lines:
    script = f"slow_minimal.py {' '.join(ARGS)} --run-dir {run_dir}"
    processes = start_by_hand(
        bed,
        len(bed.nodes),
        1,
        SCRIPTS,
        port,
        run_id,
        script,
        torchrun_args="--max-restarts=1",
        with_stderr=True,
    )
    return Lines(processes)


def measure(
    bed: Testbed,
    fault: str,
    runner: str,
    extra: list[str],
    cap: float,
    scratch: Path,
) -> tuple[float | None, float | None]:
    """(seconds to detection, seconds to the first resumed step); None past the cap."""
    work = Path(tempfile.mkdtemp(dir=scratch))
    run_dir, home = work / "run", work / "home"
    run_id = f"bench{os.getpid()}{int(time.time())}"
    lines = (
        start_herd(bed, work, home, run_dir, extra)
        if runner == "herd"
        else start_torchrun(bed, run_dir, run_id, 29300 + int(time.time()) % 500)
    )
    stopped: list[int] = []
    cut: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "snapshots" / "step-40").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{runner}: no snapshot in time")
            time.sleep(0.1)
        tag = (
            ("HERD_JOB_ID", next((home / "jobs").iterdir()).name)
            if runner == "herd"
            else ("TORCHELASTIC_RUN_ID", run_id)
        )
        injected = time.monotonic()
        skip: frozenset[int] = frozenset()
        if fault == "worker-killed":
            os.kill(worker_pid(bed, tag, "node2", "RANK=1"), signal.SIGKILL)
        elif fault == "hang":
            victim = worker_pid(bed, tag, "node2", "RANK=1")
            os.kill(victim, signal.SIGSTOP)
            stopped.append(victim)
        else:
            node = "node3" if fault == "node-lost" else "node1"
            bed.partition(node)
            cut.append(node)
            # A cut-off node's own lines do not count as the survivors noticing (torchrun by
            # hand: one output per node; herd has one launcher output, never on a node).
            if runner == "torchrun":
                skip = frozenset({bed.nodes.index(bed.node(node))})
        pattern = HERD_NOTICES if runner == "herd" else TORCHRUN_NOTICES
        detected = resumed = None
        while time.monotonic() - injected < cap:
            if detected is None:
                found = lines.first(pattern, injected, skip)
                exited = [i for i, p in enumerate(lines.processes) if p.poll() is not None]
                if found is None and any(i not in skip for i in exited):
                    found = time.monotonic()
                detected = None if found is None else found - injected
            found = lines.first_after_resume(injected)
            if found is not None:
                resumed = found - injected
                break
            if all(p.poll() is not None for p in lines.processes):
                break
            time.sleep(0.2)
        return detected, resumed
    finally:
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
        tags = [("TORCHELASTIC_RUN_ID", run_id)]
        if (home / "jobs").is_dir():
            tags += [("HERD_JOB_ID", job.name) for job in (home / "jobs").iterdir()]
        for key, value in tags:  # whatever a runner left behind, by its tag
            for pid in bed.processes_with_env(key, value):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def shown(seconds: float | None, cap: float) -> str:
    return f"> {cap:.0f} s" if seconds is None else f"{seconds:.1f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", type=float, default=180)
    parser.add_argument("--faults", default="worker-killed,node-lost,hang,hang-20,rdzv-host-lost")
    parser.add_argument("--no-torchrun", action="store_true", help="measure herd only")
    args = parser.parse_args()
    rows: list[tuple[str, str, str, str]] = []
    runs: list[tuple[str, str, list[str]]] = []
    for fault in args.faults.split(","):
        extra = ["--hang-timeout", "20"] if fault == "hang-20" else []
        name = "hang" if fault.startswith("hang") else fault
        runs.append((fault, "herd", extra))
        if not args.no_torchrun and fault != "hang-20":
            runs.append((fault, "torchrun", []))
    say: Callable[[str], None] = lambda text: print(text, flush=True)  # noqa: E731
    with Testbed(3) as bed, tempfile.TemporaryDirectory(prefix="herd-bench-") as scratch:
        for fault, runner, extra in runs:
            name = "hang" if fault.startswith("hang") else fault
            detected, resumed = measure(bed, name, runner, extra, args.cap, Path(scratch))
            label = f"{fault} ({runner}{' ' + ' '.join(extra) if extra else ''})"
            rows.append((label, shown(detected, args.cap), shown(resumed, args.cap), runner))
            say(f"{label}: detected {rows[-1][1]}, first resumed step {rows[-1][2]}")
    say("\nfault (runner)                         detection    first resumed step")
    for label, detected_text, resumed_text, _ in rows:
        say(f"{label:<38} {detected_text:>10}    {resumed_text:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
