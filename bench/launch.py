"""Launch latency: `herd launch` vs the hand-made recipe, on the namespace testbed.

Measures the time from the command to every rank's first line of output, for
  - herd:     `herd launch -c herd.toml first_line.py`
  - baseline: torchrun started at once on every node with plain ssh, with the address and
              interface fixes typed by hand (--rdzv-conf is_host, --local-addr, *_SOCKET_IFNAME)
  - pdsh:     what DeepSpeed's launcher does with its default runner: one `pdsh -R ssh` over
              every node, each node's rank from pdsh's %n, a static rendezvous on the first
              node (torchrun --node-rank=%n --master-addr); skipped when pdsh is not installed
              (Debian: apt-get install pdsh)
Runs alternate (baseline, pdsh, herd, baseline...) and the medians are compared.
Prints `ratio = herd / baseline` and `herd / pdsh`; the target is <= 1.0 against both.
Needs root (builds the testbed).

    python bench/launch.py [--nodes 2] [--nproc 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
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
import os
import torch  # a real training script imports torch first
print(f"FIRST rank={os.environ['RANK']}", flush=True)
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def wait_for_ranks(streams: list, world: int, started: float) -> float:
    """Read the streams until every rank printed its first line; seconds since ``started``."""
    seen: set[str] = set()
    done = threading.Event()
    lock = threading.Lock()
    finished_at = [0.0]

    def read(stream) -> None:
        for line in stream:
            match = re.search(r"FIRST rank=(\d+)", line)
            if match:
                with lock:
                    seen.add(match.group(1))
                    if len(seen) == world and not done.is_set():
                        finished_at[0] = time.monotonic()
                        done.set()

    threads = [threading.Thread(target=read, args=(s,), daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    if not done.wait(180):
        raise RuntimeError(f"only ranks {sorted(seen)} printed within 180 s")
    return finished_at[0] - started


def run_herd(bed: Testbed, cluster_file: Path, workdir: Path, world: int, home: Path) -> float:
    env = dict(os.environ, HERD_HOME=str(home), PYTHONUNBUFFERED="1")
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "torchherd", "launch", "-c", str(cluster_file), "first_line.py"],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    elapsed = wait_for_ranks([process.stdout], world, started)
    if process.wait(120) != 0:
        raise RuntimeError("herd launch failed")
    return elapsed


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
    bed: Testbed, nodes: int, nproc: int, workdir: Path, port: int, run_id: str
) -> float:
    started = time.monotonic()
    processes = start_by_hand(bed, nodes, nproc, workdir, port, run_id, "first_line.py")
    elapsed = wait_for_ranks([p.stdout for p in processes], nodes * nproc, started)
    for process in processes:
        if process.wait(120) != 0:
            raise RuntimeError("baseline torchrun failed")
    return elapsed


def run_pdsh(bed: Testbed, nodes: int, nproc: int, workdir: Path, port: int) -> float:
    """DeepSpeed's pdsh runner, reproduced: one pdsh over every node, ranks from %n."""
    first, hosts = bed.nodes[0], bed.nodes[:nodes]
    iface = first.iface  # the testbed's nodes all name their interface alike
    command = (
        f"cd {workdir} && NCCL_SOCKET_IFNAME={iface} GLOO_SOCKET_IFNAME={iface} "
        f"PYTHONUNBUFFERED=1 {sys.executable} -m torch.distributed.run --nnodes={nodes} "
        f"--nproc-per-node={nproc} --node-rank=%n --master-addr={first.addr} "
        f"--master-port={port} first_line.py"
    )
    env = dict(os.environ, PDSH_SSH_ARGS=f"-F {bed.ssh_config} -o BatchMode=yes -x -l%u %h")
    started = time.monotonic()
    process = subprocess.Popen(
        ["pdsh", "-S", "-R", "ssh", "-f", "1024", "-w", ",".join(n.name for n in hosts), command],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    elapsed = wait_for_ranks([process.stdout], nodes * nproc, started)
    if process.wait(120) != 0:
        raise RuntimeError("pdsh's torchrun failed")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    world = args.nodes * args.nproc
    with Testbed(args.nodes) as bed, tempfile.TemporaryDirectory(prefix="herd-bench-") as scratch:
        workdir = Path(scratch)
        (workdir / "first_line.py").write_text(FIRST_LINE)
        home = workdir / "home"
        cluster_file = bed.write_cluster_file(
            workdir / "herd.toml",
            nodes=[{"host": n.name, "nproc": args.nproc} for n in bed.nodes[: args.nodes]],
            workdir=str(workdir),
            env={"HERD_HOME": str(home)},
        )
        herd_times, base_times, pdsh_times = [], [], []
        with_pdsh = shutil.which("pdsh") is not None
        if not with_pdsh:
            print("pdsh is not installed: no DeepSpeed-style baseline (apt-get install pdsh)")
        # One untimed run of each warms the page cache (torch import) for all alike.
        run_baseline(bed, args.nodes, args.nproc, workdir, 29400, "warm")
        if with_pdsh:
            run_pdsh(bed, args.nodes, args.nproc, workdir, 29450)
        run_herd(bed, cluster_file, workdir, world, home)
        for repeat in range(args.repeats):
            base_times.append(
                run_baseline(bed, args.nodes, args.nproc, workdir, 29401 + repeat, f"b{repeat}")
            )
            if with_pdsh:
                pdsh_times.append(run_pdsh(bed, args.nodes, args.nproc, workdir, 29451 + repeat))
            herd_times.append(run_herd(bed, cluster_file, workdir, world, home))
            pdsh = f"   pdsh {pdsh_times[-1]:.2f} s" if pdsh_times else ""
            print(
                f"run {repeat + 1}: baseline {base_times[-1]:.2f} s{pdsh}   "
                f"herd {herd_times[-1]:.2f} s",
                flush=True,
            )
    herd_median, base_median = statistics.median(herd_times), statistics.median(base_times)
    print(f"\n{args.nodes} nodes x {args.nproc} workers, {args.repeats} runs each (median):")
    print(f"  baseline (torchrun by hand over ssh): {base_median:.2f} s")
    if pdsh_times:
        print(f"  pdsh (DeepSpeed's runner):            {statistics.median(pdsh_times):.2f} s")
    print(f"  herd launch:                          {herd_median:.2f} s")
    against = [("baseline", base_median)]
    if pdsh_times:
        against.append(("pdsh", statistics.median(pdsh_times)))
    for name, median in against:
        ratio = herd_median / median
        verdict = "met" if ratio <= 1.0 else "NOT met"
        print(f"ratio herd / {name} = {ratio:.3f}  (target <= 1.0: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
