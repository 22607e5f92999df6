"""Real nodes: what the launcher costs per node over real ssh, on the namespace testbed.

N testbed nodes (real sshd each, one Gloo worker a node); the launcher is the `herd` command.
Phases (each one run):

  exec       herd exec -- true
  launch     herd launch of a trivial job (every rank all-reduces once), to its end
  interrupt  a long job, stopped with Ctrl-C (SIGINT) once every rank steps
  lost       a long job with --max-restarts 1 --min-nodes N-1; once every rank steps, the last
             node's link goes down: herd must go on without it and finish the job

Each launch phase runs in two modes: ``flat`` (an ssh connection per node, herd's default: the
tree is off unless ``tree_above`` is set) and ``tree`` (``--tree-above 1``: ssh to one inner
node per 33 nodes only, which start the other nodes' relays over their own ssh;
transport/tree.py); ``exec`` is flat in both.

For each: wall time, and the launcher's CPU per node, as the launcher process alone (/proc) and
with the ssh clients it started and waited for (wait4's rusage); the ssh masters detach after
their handshake, which is counted (their parent did it), their later traffic is not; the inner
nodes' own ssh clients run on the nodes, not here. Target: <= 20 ms per node (launcher with
its ssh clients). Needs root.

Most of the ssh clients' share is the key exchange: OpenSSH 9's default, the post-quantum
hybrid sntrup761x25519, costs about 75 ms of CPU per connection here, curve25519 about 10.
herd keeps the user's choice; ``--kex ALGORITHMS`` writes it into the testbed's ssh config, as a
user would, to measure it.

With --marginal, each launch phase also runs on the first N/2 nodes, and the bench prints what
each node past N/2 added (the difference over N/2): the launch's fixed part (the interpreter,
herd's imports, the inner nodes' ssh connections), the same in both runs, drops out.

    python bench/ssh_scale.py [--nodes 32] [--phases exec,launch,interrupt,lost] [--profile DIR]
                              [--modes flat,tree] [--kex curve25519-sha256] [--hang-timeout S]
                              [--marginal]
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
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.testbed import Testbed  # noqa: E402

SCRIPTS = REPO / "tests" / "integration" / "scripts"
TICKS = os.sysconf("SC_CLK_TCK")
TARGET_MS = 20.0
MODES = {"flat": [], "tree": ["--tree-above", "1"]}


@dataclass
class Run:
    phase: str
    mode: str
    nodes: int
    wall: float
    own_cpu: float
    with_children_cpu: float
    code: int
    ok: bool
    note: str = ""
    first_second_cpu: float = 0.0
    """The launcher's own CPU in its first second (interpreter, imports, parsing, the plan):
    the same whatever the start's length. The rest grows with the wall time (its event loop
    while the nodes import torch), which on this machine's shared cores is what varies."""

    @property
    def later_cpu_per_second(self) -> float:
        return max(0.0, self.own_cpu - self.first_second_cpu) / max(self.wall - 1.0, 1e-9)


def own_cpu(pid: int) -> float | None:
    """A process's own CPU seconds so far, from /proc; None once it is gone or a zombie (the
    caller keeps its last reading)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


class Launcher:
    """One herd command: its output lines (with when they came), its own CPU, its rusage."""

    def __init__(self, argv: list[str], env: dict[str, str], profile: Path | None) -> None:
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torchherd", *argv],
            cwd=SCRIPTS,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.own_cpu = 0.0
        self.first_second_cpu: float | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        threading.Thread(target=self._first_second, daemon=True).start()
        self.profiler = None
        if profile is not None:
            self.profiler = subprocess.Popen(
                ["py-spy", "record", "--pid", str(self.process.pid), "--format", "raw"]
                + ["--output", str(profile), "--rate", "200", "--nolineno", "--nonblocking"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

    def _first_second(self) -> None:
        """The launcher's own CPU one second after it started (None if it had ended)."""
        time.sleep(max(0.0, self.started + 1.0 - time.monotonic()))
        self.first_second_cpu = own_cpu(self.process.pid)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def count(self, pattern: str) -> int:
        return sum(1 for _, line in list(self.lines) if re.search(pattern, line))

    def wait_for(self, pattern: str, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.count(pattern) < count:
            if time.monotonic() > deadline or self.exited():
                return False
            time.sleep(0.1)
        return True

    def exited(self) -> bool:
        """Whether the launcher has ended, leaving it unreaped: finish() reaps it with wait4,
        the only way to learn what its waited-for children used."""
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, self.process.pid, flags) is not None

    def finish(self, timeout: float = 600) -> tuple[int, float, float, float]:
        """(exit code, wall s, own CPU s, CPU s with waited-for children)."""
        deadline = time.monotonic() + timeout
        pid = self.process.pid
        while True:
            cpu = own_cpu(pid)
            if cpu is not None:
                self.own_cpu = cpu
            # wait4 reaps it and says what it and the children it waited for used.
            found, status, usage = os.wait4(pid, os.WNOHANG)
            if found:
                break
            if time.monotonic() > deadline:
                self.process.kill()
            time.sleep(0.05)
        wall = time.monotonic() - self.started
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self.reader.join(5)
        if self.profiler is not None:
            self.profiler.send_signal(signal.SIGINT)
            self.profiler.wait(60)
        total = usage.ru_utime + usage.ru_stime
        return self.process.returncode, wall, self.own_cpu, total


# Every rank's lines on the console (each rank prints a couple), so that the bench sees every
# rank start and step: above 16 nodes herd shows rank 0's by default.
EVERY_RANK = ["--ranks", "all"]


def herd_env(home: Path) -> dict[str, str]:
    return dict(os.environ, HERD_HOME=str(home), PYTHONUNBUFFERED="1")


def run_phase(
    phase: str,
    mode: str,
    bed: Testbed,
    cluster: Path,
    nodes: int,
    home: Path,
    profile: Path | None,
    hang_timeout: str | None = None,
) -> Run:
    env = herd_env(home)
    out = profile / f"{phase}-{mode}-{nodes}.txt" if profile else None
    how = ["-c", str(cluster), *MODES[mode]]
    note = ""
    if phase == "exec":
        launcher = Launcher(["exec", "-c", str(cluster), "--", "true"], env, out)
        code, wall, own, total = launcher.finish()
        ok = code == 0
    elif phase == "launch":
        launcher = Launcher(["launch", *how, *EVERY_RANK, "allreduce.py"], env, out)
        code, wall, own, total = launcher.finish()
        ok = code == 0 and launcher.count(r"RESULT rank=") == nodes
    elif phase == "interrupt":
        launcher = Launcher(["launch", *how, *EVERY_RANK, "steps.py", "--quiet"], env, out)
        stepping = launcher.wait_for(r"STEPPING rank=", nodes, 300)
        asked = time.monotonic()
        launcher.process.send_signal(signal.SIGINT)
        code, wall, own, total = launcher.finish()
        ok = stepping and code == 130
        note = f"stopped {time.monotonic() - asked:.1f} s after Ctrl-C"
    else:
        argv = ["launch", *how, *EVERY_RANK, "--max-restarts", "1", "--min-nodes"]
        argv += [str(nodes - 1)]
        if hang_timeout is not None:
            argv += ["--hang-timeout", hang_timeout]
        argv += ["steps.py", "--quiet", "--steps", "300"]
        launcher = Launcher(argv, env, out)
        stepping = launcher.wait_for(r"STEPPING rank=", nodes, 300)
        victim = bed.nodes[nodes - 1]
        cut = time.monotonic()
        bed.partition(victim)
        try:
            noticed = launcher.wait_for(rf"{victim.name} stopped answering", 1, 120)
            noticed_after = time.monotonic() - cut
            code, wall, own, total = launcher.finish()
        finally:
            bed.heal(victim)
        went_on = launcher.count(rf"going on without {victim.name}") == 1
        ok = stepping and noticed and went_on and code == 0
        note = f"lost node noticed after {noticed_after:.1f} s, went on without it: {went_on}"
    if not ok:
        tail = "\n".join(line for _, line in launcher.lines[-25:])
        note += f"\n--- last lines ---\n{tail}"
    first = launcher.first_second_cpu if launcher.first_second_cpu is not None else own
    return Run(phase, mode, nodes, wall, own, total, code, ok, note, first)


def print_marginal(runs: list[Run]) -> None:
    """What each node past the smaller count added to the launcher's CPU with its ssh clients:
    the difference between two runs of one phase and mode over the difference in nodes. A
    launch's fixed part (the interpreter, herd's imports, the inner nodes' ssh connections)
    is the same in both and drops out; the time-dependent part (the launcher's event loop while
    more nodes import torch on the same cores) does not."""
    by_kind: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        by_kind.setdefault((run.phase, run.mode), []).append(run)
    for (phase, mode), pair in by_kind.items():
        if len(pair) != 2 or not all(run.ok for run in pair):
            continue
        small, large = sorted(pair, key=lambda run: run.nodes)
        added = (large.with_children_cpu - small.with_children_cpu) * 1000
        per_node = added / (large.nodes - small.nodes)
        print(
            f"{phase} ({mode}): each node past {small.nodes} added {per_node:.1f} ms of launcher "
            f"CPU with its ssh clients ({small.nodes} nodes: {small.with_children_cpu:.2f} s, "
            f"{large.nodes}: {large.with_children_cpu:.2f} s; <= {TARGET_MS:g}): "
            f"{'met' if per_node <= TARGET_MS else 'NOT met'}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--phases", default="exec,launch,interrupt,lost")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy raw stacks here")
    parser.add_argument(
        "--modes", default="flat,tree", help="flat, tree, or both: flat,tree (launches)"
    )
    parser.add_argument("--kex", default=None, help="KexAlgorithms for the nodes' ssh config")
    parser.add_argument(
        "--marginal",
        action="store_true",
        help="also run each launch phase on the first half of the nodes, and print what each "
        "node past the half added (the launch's fixed part left out)",
    )
    parser.add_argument(
        "--hang-timeout",
        default=None,
        help="for the lost phase: N nodes re-importing torch on this machine's cores may be "
        "silent longer than herd's default limit",
    )
    args = parser.parse_args()
    modes = list(MODES) if args.modes == "both" else args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: unknown {', '.join(unknown)} (flat, tree or both)")
    if args.marginal and args.nodes < 4:
        parser.error(
            f"--marginal compares {args.nodes} nodes with half as many: give --nodes 4 or more"
        )
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    with Testbed(args.nodes) as bed, tempfile.TemporaryDirectory(prefix="herd-bssh-") as scratch:
        home = Path(scratch) / "home"
        if args.kex:
            config = bed.ssh_config.read_text()
            bed.ssh_config.write_text(f"Host *\n    KexAlgorithms {args.kex}\n\n{config}")
        sizes = [args.nodes // 2, args.nodes] if args.marginal else [args.nodes]
        clusters = {
            size: bed.write_cluster_file(
                Path(scratch) / f"herd-{size}.toml",
                nodes=[{"host": n.name, "nproc": 1} for n in bed.nodes[:size]],
                workdir=str(SCRIPTS),
                env={"HERD_HOME": str(home)},
                # N nodes' probes share this machine's 2 cores: give them time (a replan's
                # probe waits connect_timeout + 5 s).
                connect_timeout=30,
            )
            for size in sizes
        }
        for phase in args.phases.split(","):
            # exec is herd exec, flat in every mode; the launches run in each mode asked.
            for mode in ["flat"] if phase == "exec" else modes:
                for size in sizes:
                    print(f"{phase} ({mode}) on {size} nodes...", flush=True)
                    cluster = clusters[size]
                    run = run_phase(
                        phase, mode, bed, cluster, size, home, args.profile, args.hang_timeout
                    )
                    runs.append(run)
                    print(
                        f"  {'ok' if run.ok else 'FAILED'} (exit {run.code}) in {run.wall:.1f} "
                        f"s; launcher {run.own_cpu * 1000 / run.nodes:.0f} ms/node, with its "
                        f"ssh clients {run.with_children_cpu * 1000 / run.nodes:.0f} ms/node  "
                        f"{run.note}",
                        flush=True,
                    )
    print()
    # The launcher's own CPU split: its first second (fixed) and each second after it (which
    # a longer start on busier cores multiplies).
    print(
        f"{'phase':10} {'mode':5} {'nodes':>5} {'wall s':>7} {'launcher ms/node':>17} "
        f"{'+ssh ms/node':>13} {'first s ms':>11} {'then ms/s':>10}"
    )
    for run in runs:
        print(
            f"{run.phase:10} {run.mode:5} {run.nodes:>5} {run.wall:>7.1f} "
            f"{run.own_cpu * 1000 / run.nodes:>17.1f} "
            f"{run.with_children_cpu * 1000 / run.nodes:>13.1f} "
            f"{run.first_second_cpu * 1000:>11.0f} {run.later_cpu_per_second * 1000:>10.2f}"
        )
    print()
    for run in runs:
        per_node = run.with_children_cpu * 1000 / run.nodes
        print(
            f"{run.phase} ({run.mode}): {per_node:.0f} ms of launcher CPU per node "
            f"(<= {TARGET_MS:g}): "
            f"{'met' if per_node <= TARGET_MS else 'NOT met'}"
            + ("" if run.ok else " (the run itself FAILED)")
        )
    print_marginal(runs)
    flat = {run.phase: run for run in runs if run.mode == "flat" and run.nodes == args.nodes}
    for run in runs:
        if run.nodes != args.nodes:
            continue
        if run.mode == "tree" and run.phase in flat and flat[run.phase].with_children_cpu:
            ratio = run.with_children_cpu / flat[run.phase].with_children_cpu
            print(f"{run.phase}: tree / flat launcher CPU with its ssh clients: {ratio:.2f}")
    return 0 if all(run.ok for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
