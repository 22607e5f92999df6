"""Building a simulated cluster: N nodes on this machine, each a host of its own for herd.

A simulated cluster is a directory:

    nodes/<k>/python   node k's interpreter: a shim that runs the torchrun stand-in
                       (standin.py) for ``-m torchherd.agent.elastic`` and the real
                       interpreter for everything else (probe, agent, verbs); while the
                       fork server runs (forkserver.py), the agent and the stand-in are
                       forked from it instead, and the shim waits for them
    forkserver/        the fork server's request FIFO and the shims' answer FIFOs
    forkserver.log     what the fork server said (a traceback, if it failed)
    work/simjob.py     the job's script (the stand-in reads its arguments; nothing runs it)
    home/              the launcher's HERD_HOME: job records, the job's logs
    node-home/         the nodes' HERD_HOME: node directories, beat files (or elsewhere: a
                       tmpfs keeps the nodes' writes off the launcher's disk)
    control.json       what the ranks do now (see standin.py); change it while the job runs
    events             what the stand-ins did: ``warm|run|silent|exit NODE [CODE] WALLTIME``,
                       and ``fanout NODE WALLTIME``: a tree's fan-out started on NODE
    cluster.json       how it was built, for the launcher (launcher.py)

Every node is planned and checked as a node of a cluster reached over the network (rendezvous
on the first, explicit addresses: this machine's own), and reached through SimulatedHosts. The
nodes' processes run at a lower CPU priority than the launcher (see SHIM).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchherd.agent.probe import interfaces
from torchherd.plan import JobSpec
from torchherd.spec import ClusterSpec, NodeSpec

# ROOT_VAR: set by every node's shim; what the simulated cluster started carries it.
from .standin import EVENTS_FILE, ROOT_VAR

STANDIN = Path(__file__).resolve().with_name("standin.py")
REPO = Path(__file__).resolve().parents[2]

SHIM = """#!/bin/sh
# Simulated node {index}: the real python, except for torchrun's wrapper, which is stood in for.
if [ "${root_var}" != {root} ] || [ "${var}" != {index} ]; then
    # Once more with the node's variables in this shell's own environment, where /proc shows
    # them: what the simulated cluster runs is found by them (SimCluster.processes).
    {var}={index} {root_var}={root} exec /bin/sh "$0" "$@"
fi
if [ "$1" = "-m" ] && [ -p {requests} ] && case "$2" in
    torchherd.agent|torchherd.agent.elastic|torchherd.agent.relay|torchherd.agent.fanout) ;;
    *) false ;; esac; then
    # herd's agent, torchrun's stand-in, or a tree's relay or fan-out, forked by the fork
    # server (forkserver.py): this shell passes on the signals it gets and ends with the
    # forked process's exit status. The server takes its streams from descriptors 5-7
    # (``read`` moves 0 while it waits), its variables from its environment (the two above
    # are not there: they come with the pid).
    answer={answers}/$$
    exec 5<&0 6>&1 7>&2
    for sig in TERM INT HUP; do
        trap "caught=$sig; \\${{pid:+kill -$sig \\$pid}}" $sig
    done
    mkfifo -m 600 "$answer" && exec 3<>"$answer" && echo $$ {index} >{requests} || exit 255
    until read pid <&3; do :; done
    [ -n "$caught" ] && kill -"$caught" "$pid"
    until read code <&3; do :; done
    exit "$code"
fi
if [ "$1" = "-m" ] && [ "$2" = "torchherd.agent.elastic" ]; then
    shift 2
    exec nice -n {standin_nice} {python} -S {standin} "$@"
fi
exec nice -n {agent_nice} {python} "$@"
"""
# CPU priorities of what the nodes run. On this one machine they stand for N machines, each of
# which would have cores of its own: herd's agents keep the launcher's priority, the stand-ins
# (the workload, which would run on the nodes' other cores) get the lowest, so that they do
# not starve the agents' and the launcher's heartbeats.
AGENT_NICE = 0
STANDIN_NICE = 19

JOB_SCRIPT = '''"""The simulated cluster's job: torchrun's stand-in reads its arguments."""
'''


def this_machine_address() -> str:
    """An address of this machine other nodes could use (its first non-loopback IPv4)."""
    for interface in interfaces():
        if interface["up"] and not interface["loopback"]:
            return str(interface["addr"])
    return socket.gethostbyname(socket.gethostname())


@dataclass
class SimCluster:
    """A simulated cluster of ``nodes`` nodes with ``nproc`` ranks each, under ``root``."""

    root: Path
    nodes: int
    nproc: int = 8
    node_home: Path | None = None
    py_spy: bool = True
    """Whether the nodes' agents have py-spy (forked agents only: without it, herd reports
    "py-spy is not installed on this node" for every rank instead of its stacks). Above a few
    hundred nodes, N x 8 py-spy at once (herd takes every rank's stacks when it stops a job)
    would take more of this one machine's process table than it has."""
    """The nodes' HERD_HOME; default: ROOT/node-home."""

    @property
    def control_file(self) -> Path:
        return self.root / "control.json"

    @property
    def events_file(self) -> Path:
        return self.root / EVENTS_FILE

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def nodes_home(self) -> Path:
        return self.node_home or self.root / "node-home"

    @property
    def workdir(self) -> Path:
        return self.root / "work"

    def python(self, index: int) -> Path:
        return self.root / "nodes" / str(index) / "python"

    def build(self, **control: Any) -> SimCluster:
        """Write the directory (shims, job script, control file); returns self."""
        from .forkserver import requests_fifo
        from .standin import NODE_INDEX_VAR

        for index in range(self.nodes):
            shim = self.python(index)
            shim.parent.mkdir(parents=True, exist_ok=True)
            shim.write_text(
                SHIM.format(
                    index=index,
                    var=NODE_INDEX_VAR,
                    root_var=ROOT_VAR,
                    root=shlex.quote(str(self.root)),
                    python=shlex.quote(sys.executable),
                    standin=shlex.quote(str(STANDIN)),
                    agent_nice=AGENT_NICE,
                    standin_nice=STANDIN_NICE,
                    requests=shlex.quote(str(requests_fifo(self.root))),
                    answers=shlex.quote(str(requests_fifo(self.root).parent)),
                )
            )
            shim.chmod(0o755)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "simjob.py").write_text(JOB_SCRIPT)
        self.home.mkdir(exist_ok=True)
        self.nodes_home.mkdir(parents=True, exist_ok=True)
        self.events_file.touch()
        self.set_control(**({"lines_per_second": 1, "beats_per_second": 1} | control))
        description = {
            "nodes": self.nodes,
            "nproc": self.nproc,
            "addr": this_machine_address(),
            "node_home": str(self.nodes_home),
            "py_spy": self.py_spy,
        }
        (self.root / "cluster.json").write_text(json.dumps(description))
        return self

    @classmethod
    def open(cls, root: Path) -> SimCluster:
        description = json.loads((root / "cluster.json").read_text())
        return cls(
            root,
            description["nodes"],
            description["nproc"],
            Path(description["node_home"]),
            description.get("py_spy", True),
        )

    def spec(self) -> ClusterSpec:
        addr = json.loads((self.root / "cluster.json").read_text())["addr"]
        nodes = tuple(
            NodeSpec(host=f"sim{k}", nproc=self.nproc, addr=addr, python=str(self.python(k)))
            for k in range(self.nodes)
        )
        return ClusterSpec(
            nodes=nodes,
            workdir=str(self.workdir),
            env={"HERD_HOME": str(self.nodes_home)},
            # The nodes share this machine's address; it may be a public one.
            allow_public_rendezvous=True,
            source=f"simulated cluster {self.root}",
        )

    def job(self, seconds: float = 0, **fields: Any) -> JobSpec:
        entry = ["simjob.py", "--control", str(self.control_file), "--events"]
        entry += [str(self.events_file), "--seconds", f"{seconds:g}"]
        return JobSpec(entry=tuple(entry), nproc=self.nproc, **fields)

    def set_control(self, **settings: Any) -> None:
        """Replace what the ranks do (atomically: a stand-in never reads half of it)."""
        temporary = self.control_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(settings))
        os.replace(temporary, self.control_file)

    def events(self) -> list[tuple[str, int, float, list[str]]]:
        """(what, node, wall time, other words) for every event so far."""
        found = []
        for line in self.events_file.read_text().splitlines():
            words = line.split()
            if len(words) >= 3:
                found.append((words[0], int(words[1]), float(words[-1]), words[2:-1]))
        return found

    def wait_events(self, what: str, count: int, timeout: float) -> list[float]:
        """Wall times of the first ``count`` events ``what`` (one per node), waiting for them."""
        deadline = time.monotonic() + timeout
        while True:
            seen: dict[int, float] = {}
            for kind, node, at, _ in self.events():
                if kind == what:
                    seen.setdefault(node, at)
            if len(seen) >= count or time.monotonic() > deadline:
                return sorted(seen.values())
            time.sleep(0.2)

    def start_forkserver(self, timeout: float = 60.0) -> subprocess.Popen[bytes]:
        """The fork server the nodes' agents come from (forkserver.py), ready; end it with
        SIGTERM once the launch is over (it exits when its agents have)."""
        from .forkserver import requests_fifo

        # Its own output goes to a file: it outlives the launcher (until the last of its
        # agents), and must not hold the launcher's streams open for the launcher's caller.
        with open(self.root / "forkserver.log", "ab") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "tests.simcluster.forkserver", str(self.root)],
                cwd=REPO,
                env=dict(os.environ, **{ROOT_VAR: str(self.root)}),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not requests_fifo(self.root).is_fifo():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start (exit {server.poll()})")
            time.sleep(0.01)
        return server

    def processes(self) -> list[int]:
        """Pids of live processes the simulated nodes run (agents, stand-ins, workers)."""
        return processes_with(f"{ROOT_VAR}={self.root}")


def processes_with(variable: str) -> list[int]:
    """Pids of live processes whose environment holds ``variable`` (NAME=VALUE) exactly."""
    wanted = variable.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if wanted in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found
