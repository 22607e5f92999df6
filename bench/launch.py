"""Launch latency: `herd launch` vs the hand-made recipe, on the namespace testbed.

Measures, on the workers' own clock (each rank prints the wall time of its first line; the
testbed's nodes share one clock), the time from the command to every rank's first line of
output (a first start), and from a rank's failure to every rank's first line of the next
attempt (a restart in place: `--max-restarts 1`, torchrun's own restart for the others), for
  - herd:     `herd launch -c herd.toml first_line.py`
  - baseline: torchrun started at once on every node with plain ssh, with the address and
              interface fixes typed by hand (--rdzv-conf is_host, --local-addr, *_SOCKET_IFNAME)
  - pdsh:     what DeepSpeed's launcher does with its default runner: one `pdsh -R ssh` over
              every node, each node's rank from pdsh's %n, a static rendezvous on the first
              node (torchrun --node-rank=%n --master-addr); skipped when pdsh is not installed
              (Debian: apt-get install pdsh)
Runs alternate (baseline, pdsh, herd, baseline...) and the medians are compared.
Prints `ratio = herd / baseline` (target <= 0.9) and `herd / pdsh` (target <= 1.0), for the
first start and for the restart, and the median of each phase of herd's starts (the job
record's breakdown, startup.py). Needs root (builds the testbed).

For the restart, rank 0 fails ``--fail-after`` seconds after every rank's first step (5 by
default: a failure mid-training, as failures come; herd's agents warm the next attempt's
wrapper once the job steps, torchrun keeps its own agent's import). ``--fail-after 0`` fails at
the first step, where herd's wrapper for the next attempt is still importing torch.

    python bench/launch.py [--nodes 3] [--nproc 1] [--repeats 5] [--fail-after 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.testbed import Testbed  # noqa: E402

FIRST_LINE = """\
import os, sys, time
import torch  # a real training script imports torch first
FAIL_AFTER_S = 0.0
# A worker started after rank 0's failure is the restart's (torchrun's restart count is per
# node: the nodes it restarts for a membership change keep theirs).
attempt = int(os.path.exists("failed-once"))
print(f"FIRST rank={os.environ['RANK']} attempt={attempt} at={time.time():.4f}", flush=True)
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
from torchherd import progress
progress.beat(0)  # the first step (herd's start phases end here; a no-op under torchrun)
if "--fail-once" in sys.argv and attempt == 0:
    time.sleep(FAIL_AFTER_S)  # training, until rank 0 fails (--fail-after)
    if os.environ["RANK"] == "0":
        open("failed-once", "w").close()
        print(f"FAIL at={time.time():.4f}", flush=True)
        os._exit(1)
    dist.barrier()  # fails once rank 0 is gone
dist.destroy_process_group()
"""

# Each run's result: seconds to every rank's first line (first start), and with --fail-once
# from rank 0's failure to every rank's first line of the next attempt (restart).
Times = tuple[float, float | None]


def wait_for_ranks(
    streams: list, world: int, started: float, restart: bool, keep: list[str] | None = None
) -> Times:
    """Read the streams until every rank printed its first line (of the second attempt too,
    with ``restart``); seconds from ``started`` (wall clock) by the ranks' own clocks."""
    firsts: dict[int, dict[str, float]] = {0: {}, 1: {}}
    failed = [0.0]
    done = threading.Event()
    lock = threading.Lock()

    def read(stream) -> None:
        for line in stream:
            if keep is not None:
                keep.append(line.rstrip("\n"))
            match = re.search(r"FIRST rank=(\d+) attempt=(\d+) at=([\d.]+)", line)
            fail = re.search(r"FAIL at=([\d.]+)", line)
            with lock:
                if match:
                    firsts[min(int(match[2]), 1)][match[1]] = float(match[3])
                if fail:
                    failed[0] = float(fail[1])
                if len(firsts[0]) == world and (not restart or len(firsts[1]) == world):
                    done.set()

    threads = [threading.Thread(target=read, args=(s,), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    if not done.wait(240):
        raise RuntimeError(f"only ranks {firsts} printed within 240 s")
    first = max(firsts[0].values()) - started
    again = max(firsts[1].values()) - failed[0] if restart else None
    return first, again


def run_herd(
    bed: Testbed, cluster_file: Path, workdir: Path, world: int, home: Path, restart: bool
) -> Times:
    env = dict(os.environ, HERD_HOME=str(home), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "torchherd", "launch", "-c", str(cluster_file), "-v"]
    if restart:
        command += ["--max-restarts", "1", "first_line.py", "--fail-once"]
    else:
        command += ["first_line.py"]
    started = time.time()
    process = subprocess.Popen(
        command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    said: list[str] = []
    elapsed = wait_for_ranks([process.stdout], world, started, restart, said)
    if process.wait(120) != 0:
        raise RuntimeError("herd launch failed")
    HERD_SAID["last"] = said  # the reader may still be adding its last lines
    return elapsed


HERD_SAID: dict[str, list[str]] = {"last": []}
"""The last herd launch's console lines (its -v breakdown is printed at the end)."""


def herd_phases(home: Path) -> list[dict[str, float]]:
    """The newest herd job's start phases, one dict per attempt (the job record's)."""
    newest = max((home / "jobs").glob("*/job.json"), key=lambda p: p.stat().st_mtime)
    attempts = json.loads(newest.read_text())["attempts"]
    return [a.get("phases") or {} for a in attempts]


def start_by_hand(
    bed: Testbed,
    nodes: int,
    nproc: int,
    workdir: Path,
    port: int,
    run_id: str,
    script: str,
    *,
    torchrun_args: str = "",
    nnodes: str | None = None,
    with_stderr: bool = False,
) -> list[subprocess.Popen[str]]:
    """The hand-made recipe: torchrun on every node at once over plain ssh, with the address
    and interface fixes typed by hand. ``script`` is the script and its arguments;
    ``torchrun_args`` more of torchrun's own; ``nnodes`` its elastic form ("2:3", default: the
    node count); ``with_stderr`` merges stderr into the output."""
    first = bed.nodes[0]
    processes = []
    for index, node in enumerate(bed.nodes[:nodes]):
        command = (
            f"cd {workdir} && NCCL_SOCKET_IFNAME={node.iface} GLOO_SOCKET_IFNAME={node.iface} "
            f"PYTHONUNBUFFERED=1 {sys.executable} -m torch.distributed.run "
            f"--nnodes={nnodes or nodes} "
            f"--nproc-per-node={nproc} {torchrun_args} "
            f"--rdzv-backend=c10d --rdzv-endpoint={first.addr}:{port} --rdzv-id={run_id} "
            f"--rdzv-conf=is_host={1 if index == 0 else 0} --local-addr={node.addr} {script}"
        )
        processes.append(
            subprocess.Popen(
                ["ssh", "-F", str(bed.ssh_config), "-o", "BatchMode=yes", node.name, command],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if with_stderr else subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # the bench, not the terminal, ends them
            )
        )
    return processes


def run_baseline(
    bed: Testbed, nodes: int, nproc: int, workdir: Path, port: int, run_id: str, restart: bool
) -> Times:
    started = time.time()
    script = "first_line.py --fail-once" if restart else "first_line.py"
    processes = start_by_hand(
        bed, nodes, nproc, workdir, port, run_id, script,
        torchrun_args="--max-restarts=1" if restart else "",
    )  # fmt: skip
    elapsed = wait_for_ranks([p.stdout for p in processes], nodes * nproc, started, restart)
    for process in processes:
        if not restart and process.wait(120) != 0:
            raise RuntimeError("baseline torchrun failed")
        if restart:
            end_measured(bed, process)
    return elapsed


# Runs of torchrun's own restart that were measured but did not end by themselves (a node's
# agent left waiting in another rendezvous round after every rank's restart had printed).
STUCK_AFTER_RESTART: list[str] = []


def end_measured(
    bed: Testbed, process: subprocess.Popen[str], name: str = "torchrun by hand"
) -> None:
    """A restart run is measured once every rank printed again; what does not end in 30 s
    after that is stopped and counted: its ssh clients here (their process group), and what
    they left running on the nodes (torchrun's agent and ranks, waiting in a rendezvous or a
    barrier: left there, a few runs' worth would take CPU from the runs that follow)."""
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        STUCK_AFTER_RESTART.append(name)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for node in bed.nodes:
            for pid in bed.node_processes(node):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def run_pdsh(
    bed: Testbed, nodes: int, nproc: int, workdir: Path, port: int, restart: bool
) -> Times:
    """DeepSpeed's pdsh runner, reproduced: one pdsh over every node, ranks from %n."""
    first, hosts = bed.nodes[0], bed.nodes[:nodes]
    iface = first.iface  # the testbed's nodes all name their interface alike
    again = "--max-restarts=1 " if restart else ""
    script = "first_line.py --fail-once" if restart else "first_line.py"
    command = (
        f"cd {workdir} && NCCL_SOCKET_IFNAME={iface} GLOO_SOCKET_IFNAME={iface} "
        f"PYTHONUNBUFFERED=1 {sys.executable} -m torch.distributed.run --nnodes={nodes} "
        f"--nproc-per-node={nproc} --node-rank=%n --master-addr={first.addr} "
        f"--master-port={port} {again}{script}"
    )
    env = dict(os.environ, PDSH_SSH_ARGS=f"-F {bed.ssh_config} -o BatchMode=yes -x -l%u %h")
    started = time.time()
    process = subprocess.Popen(
        ["pdsh", "-S", "-R", "ssh", "-f", "1024", "-w", ",".join(n.name for n in hosts), command],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    elapsed = wait_for_ranks([process.stdout], nodes * nproc, started, restart)
    if restart:
        end_measured(bed, process, "pdsh (DeepSpeed)")
    elif process.wait(120) != 0:
        raise RuntimeError("pdsh's torchrun failed")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--fail-after", type=float, default=5.0, help="seconds of training before rank 0 fails"
    )
    args = parser.parse_args()
    world = args.nodes * args.nproc
    runs: dict[str, dict[str, list[float]]] = {}
    phases: dict[str, dict[str, list[float]]] = {"start": {}, "restart": {}}
    with Testbed(args.nodes) as bed, tempfile.TemporaryDirectory(prefix="herd-bench-") as scratch:
        workdir = Path(scratch)
        (workdir / "first_line.py").write_text(
            FIRST_LINE.replace("FAIL_AFTER_S = 0.0", f"FAIL_AFTER_S = {args.fail_after!r}")
        )
        home = workdir / "home"
        cluster_file = bed.write_cluster_file(
            workdir / "herd.toml",
            nodes=[{"host": n.name, "nproc": args.nproc} for n in bed.nodes[: args.nodes]],
            workdir=str(workdir),
            env={"HERD_HOME": str(home)},
        )
        with_pdsh = shutil.which("pdsh") is not None
        if not with_pdsh:
            print("pdsh is not installed: no DeepSpeed-style baseline (apt-get install pdsh)")
        port = iter(range(29400, 29999))
        runners = {
            "torchrun by hand": lambda r, restart: run_baseline(
                bed, args.nodes, args.nproc, workdir, next(port), f"b{r}{restart:d}", restart
            ),
            **(
                {
                    "pdsh (DeepSpeed)": lambda r, restart: run_pdsh(
                        bed, args.nodes, args.nproc, workdir, next(port), restart
                    )
                }
                if with_pdsh
                else {}
            ),
            "herd launch": lambda r, restart: run_herd(
                bed, cluster_file, workdir, world, home, restart
            ),
        }
        # One untimed run of each warms the page cache (torch import) for all alike.
        for runner in runners.values():
            runner(-1, False)
        for repeat in range(args.repeats):
            said = []
            for name, runner in runners.items():
                for restart in (False, True):
                    (workdir / "failed-once").unlink(missing_ok=True)
                    times = runs.setdefault(name, {"start": [], "restart": []})
                    try:
                        first, again = runner(repeat, restart)
                    except RuntimeError as exc:  # a restart that never came: said, not timed
                        if not restart:
                            raise
                        STUCK_AFTER_RESTART.append(f"{name} (no restart: {exc})")
                        continue
                    if restart:
                        times["restart"].append(again)
                    else:
                        times["start"].append(first)
                    if name == "herd launch":
                        found = herd_phases(home)
                        kind = "restart" if restart else "start"
                        for phase, seconds in found[1 if restart else 0].items():
                            phases[kind].setdefault(phase, []).append(seconds)
                again = f"{times['restart'][-1]:.2f}" if times["restart"] else "-"
                said.append(f"{name} {times['start'][-1]:.2f}/{again} s")
            print(f"run {repeat + 1} (start/restart): " + "   ".join(said), flush=True)
    print(
        f"\n{args.nodes} nodes x {args.nproc} workers, {args.repeats} runs each (median); "
        f"restart: rank 0 fails {args.fail_after:g} s after the first step:"
    )
    print("| | first start | restart in place |")
    print("|---|---|---|")
    medians = {
        n: {k: statistics.median(v) if v else float("nan") for k, v in t.items()}
        for n, t in runs.items()
    }
    for name, found in medians.items():
        print(f"| {name} | {found['start']:.2f} s | {found['restart']:.2f} s |")
    herd = medians["herd launch"]
    for name, target in (("torchrun by hand", 0.9), ("pdsh (DeepSpeed)", 1.0)):
        if name not in medians:
            continue
        for kind in ("start", "restart"):
            ratio = herd[kind] / medians[name][kind]
            verdict = "met" if ratio <= target else "NOT met"
            print(f"ratio herd / {name}, {kind} = {ratio:.3f}  (target <= {target}: {verdict})")
    if STUCK_AFTER_RESTART:
        print(f"restart runs stopped after their measure: {', '.join(STUCK_AFTER_RESTART)}")
    print("\nthe last herd launch -v said:")
    for line in HERD_SAID["last"]:
        if line.startswith(("herd: start", "herd: restart", "  ")):
            print(line)
    for kind, found in phases.items():
        print(f"\nherd's {kind}, median of each phase (job record):")
        for phase, values in found.items():
            print(f"  {phase:<44} {statistics.median(values):6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
