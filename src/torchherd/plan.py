"""LaunchPlan: exactly what runs on each node. A pure function of spec, job and facts.

The plan never trusts name resolution (the most common multi-node failure): every node gets
explicit addresses and interfaces, found from its own routing table:
  - the rendezvous store on the first node, which every node is told: by default a static
    rendezvous (``--node-rank`` from the plan's order, the first node rank 0 and the store's
    host), since herd plans every attempt's nodes itself and restarts whole jobs, so no
    attempt needs c10d's elastic round (a join, a last call, keep-alives: about a second of
    every start); with ``rendezvous = "c10d"``, torchrun's elastic rendezvous with
    ``is_host=1`` on the first node and ``is_host=0`` elsewhere, so no node has to guess
    whether it hosts the store (a guess that fails for secondary NICs);
  - ``--local-addr`` on every node, so MASTER_ADDR is never a name resolving to 127.0.1.1;
  - NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME per node, the NIC on the route to the rendezvous
    host, unless the user set them (names differ per host, so no global value fits);
  - a unique rendezvous id per job and a port checked free on the rendezvous node.
"""

from __future__ import annotations

import ipaddress
import secrets as random_secrets
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from .agent.protocol import ATTEMPT_VAR
from .errors import ConfigError, NodeNotReady
from .facts import NodeFacts
from .hostlist import compress_hostlist
from .redact import MASK, redact_argv, redact_env
from .spec import ClusterSpec, NodeSpec

IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# On GPU nodes: what PyTorch offers for a hung or failed NCCL job and nobody turns on. The
# flight recorder keeps the last collectives of every rank and dumps them on a timeout (into
# the job's node directory: the agent sets TORCH_NCCL_DEBUG_INFO_TEMP_FILE); async error
# handling tears a rank down on an NCCL error instead of leaving it hung. A user's own value
# (in [cluster] env or the node's environment) always wins.
GPU_EVIDENCE = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}

JOB_NAME_VAR = "HERD_JOB_NAME"
"""The job's --name, for the workers (trackers may use it as the run's name)."""

ACCELERATE_CPU = "ACCELERATE_USE_CPU"
"""Set on nodes without a GPU (unless the user set it), so Accelerate scripts run distributed."""


def check_group_split(nodes: int, size: int) -> None:
    """Replica groups of ``size`` nodes (--group-nodes) must use every node of the job."""
    if size < 1 or nodes % size:
        raise ConfigError(
            f"--group-nodes {size}: the job's {nodes} node(s) do not split into replica "
            f"groups of {size}",
            f"use a --group-nodes that divides {nodes} (a group runs on all of its nodes), "
            "or select a multiple of it with --nodes",
        )


@dataclass(frozen=True)
class JobSpec:
    """What the user asked to run, independent of where."""

    entry: tuple[str, ...]
    """The script and its arguments, or the module and its arguments when ``module``."""
    module: bool = False
    """Run ``entry[0]`` as a module (like python -m)."""
    no_python: bool = False
    """Run ``entry[0]`` as a program, not with python (torchrun's --no-python)."""
    nproc: int | None = None
    """Workers on every node, overriding the cluster file and the GPU count."""
    max_restarts: int = 0
    """Times herd restarts the whole job (every node) after a failure before it fails."""
    min_nodes: int | None = None
    """Go on without lost nodes while this many remain (None: [cluster] min_nodes, else all)."""
    crash_loop: int = 3
    """Restarts in a row without step progress after which herd gives up (exit 4)."""
    attempt: int = 0
    """0 for the first run; n for the n-th restart (its own rendezvous id)."""
    job_id: str = field(default_factory=lambda: new_job_id())
    """Unique id: rendezvous id, job directory name and the tag on every process."""
    grace: float = 10.0
    """Seconds workers get to exit after SIGTERM before SIGKILL."""
    spares: int = 0
    """The cluster's last N nodes are hot spares (--spares N; herd.toml says spare = true)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Set for the workers on every node (``--env K=V``); wins over [cluster] env."""
    name: str | None = None
    """The user's name for the job (``--name``), shown by ps and matched by logs/stop."""
    replica_groups: bool = False
    """Run every node as its own torchft replica group (--replica-groups): a lost node costs
    one group, which rejoins and heals, never the job (launcher/groups.py)."""
    swap_slow: float | None = None
    """Swap out a node named slow that is still the slowest this many seconds later
    (--swap-slow): at its next snapshot, for a spare, or without it where --min-nodes allows."""
    group_nodes: int = 1
    """Nodes per replica group (--group-nodes): each group one torchrun across that many."""
    kind: str = "job"
    """"job" for what a user launched; herd's own jobs (the doctor's all-reduce, the
    benchmarks) say what they are, and `herd ps` lists them only with --all."""

    def what(self) -> str:
        """What runs, as a person would type it: ``train.py --epochs 3``, ``-m pkg.train``."""
        return shlex.join((("-m",) if self.module else ()) + tuple(self.entry))

    def entry_request(self) -> dict[str, str] | None:
        """What the probe looks for on every node before a launch: the script, the module or
        the program (found by path or on the node's PATH)."""
        if not self.entry:
            return None
        kind = "module" if self.module else "program" if self.no_python else "script"
        return {kind: self.entry[0]}


def new_job_id() -> str:
    return time.strftime("%m%d-%H%M%S") + "-" + random_secrets.token_hex(2)


@dataclass(frozen=True)
class NodePlan:
    """One node's part: its command line and environment."""

    host: str
    name: str
    python: str
    nproc: int
    local_addr: str | None
    iface: str | None
    is_host: bool
    argv: tuple[str, ...]
    env: Mapping[str, str]
    """Exported into the job on this node (no secrets: those travel separately)."""


@dataclass(frozen=True)
class LaunchPlan:
    job_id: str
    rdzv_endpoint: str | None
    """host:port of the c10d store; None for a standalone (single machine) run."""
    world_size: int
    nodes: tuple[NodePlan, ...]
    workdir: str | None
    grace: float
    secret_env: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Secrets from env_file: sent over stdin to the agents, never printed."""
    name: str | None = None
    """The job's name (``--name``), for its record."""
    what: str = ""
    """What runs (JobSpec.what()), for its record and `herd ps`."""
    kind: str = "job"
    """What launched it (JobSpec.kind), for its record."""
    warnings: tuple[str, ...] = ()
    """What will work badly though it starts (more CPU workers than cores): said at launch."""
    notes: tuple[str, ...] = ()
    """What a dry run could not know (a plan made offline: placeholders and why)."""

    def render(self) -> str:
        """The plan as text for `herd launch --dry-run`; secrets are masked."""
        lines = [
            f"job {self.job_id}: {len(self.nodes)} node(s), world size {self.world_size}, "
            + (f"rendezvous c10d at {self.rdzv_endpoint}" if self.rdzv_endpoint else "standalone"),
            f"workdir: {self.workdir or '(launcher current directory)'}",
        ]
        if self.secret_env:
            lines.append("secrets (env_file): " + ", ".join(f"{k}={MASK}" for k in self.secret_env))
        lines.extend(f"warning: {text}" for text in self.warnings)
        lines.extend(f"note: {text}" for text in self.notes)
        for node in self.nodes:
            role = "rendezvous host" if node.is_host else "worker node"
            lines.append("")
            lines.append(f"[{node.host}] {role}, {node.nproc} worker(s)")
            if node.local_addr:
                lines.append(f"  address:   {node.local_addr}")
            if node.iface:
                lines.append(f"  interface: {node.iface}")
            shown = redact_env(node.env, self.secret_env.values())
            for key, value in sorted(shown.items()):
                lines.append(f"  env:       {key}={value}")
            command = redact_argv(node.argv, self.secret_env.values())
            lines.append("  command:   " + shlex.join(command))
        return "\n".join(lines)


def make_plan(
    cluster: ClusterSpec,
    job: JobSpec,
    facts: Mapping[str, NodeFacts],
    secret_env: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """Build the plan; raises ConfigError/NodeNotReady when no correct plan exists."""
    secret_env = dict(secret_env or {})
    if cluster.transport == "local":
        return _standalone_plan(cluster, job, facts, secret_env)

    first = cluster.rendezvous_node
    rdzv_addr = _rendezvous_address(cluster, facts[first.host])
    port = cluster.rdzv_port or facts[first.host].port
    if not port:
        raise NodeNotReady(
            f"no free port for the rendezvous on {first.host}",
            "set [cluster] rdzv_port to a port that is free there",
            hosts=(first.host,),
        )
    endpoint = f"[{rdzv_addr}]:{port}" if ":" in rdzv_addr else f"{rdzv_addr}:{port}"
    # Static node ranks: the rendezvous node first (rank 0 hosts the store), then plan order.
    ranks = {node.host: rank for rank, node in enumerate([first, *_others(cluster, first)])}
    plans = []
    for node in cluster.nodes:
        node_facts = facts[node.host]
        is_host = node is first
        local_addr, iface = _address_and_iface(node, node_facts, rdzv_addr, is_host)
        nproc = node_workers(node, job, node_facts)
        env = _worker_env(cluster, node_facts, nproc, job)
        user_set = set(cluster.env) | set(node_facts.env)
        if iface:
            for name in IFNAME_VARS:
                if name not in user_set:
                    env[name] = iface
        if cluster.rendezvous == "static":
            # The first node is rank 0: the store's host (TCPStore binds on rank 0 only).
            meeting = ("--rdzv-backend=static", f"--node-rank={ranks[node.host]}")
        else:
            meeting = ("--rdzv-backend=c10d", f"--rdzv-conf=is_host={1 if is_host else 0}")
        rendezvous = (
            f"--nnodes={len(cluster.nodes)}",
            meeting[0],
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rendezvous_id(job)}",
            meeting[1],
            f"--local-addr={local_addr}",
        )
        argv = _elastic_argv(cluster.python_for(node), rendezvous, nproc, job)
        plans.append(
            NodePlan(
                host=node.host,
                name=node.name,
                python=cluster.python_for(node),
                nproc=nproc,
                local_addr=local_addr,
                iface=iface,
                is_host=is_host,
                argv=argv,
                env=env,
            )
        )
    return LaunchPlan(
        job_id=job.job_id,
        rdzv_endpoint=endpoint,
        world_size=sum(p.nproc for p in plans),
        nodes=tuple(plans),
        workdir=cluster.workdir,
        grace=job.grace,
        secret_env=secret_env,
        name=job.name,
        what=job.what(),
        kind=job.kind,
        warnings=crowded_nodes(cluster, job, facts),
    )


def _others(cluster: ClusterSpec, first: NodeSpec) -> list[NodeSpec]:
    return [node for node in cluster.nodes if node is not first]


def _standalone_plan(
    cluster: ClusterSpec, job: JobSpec, facts: Mapping[str, NodeFacts], secret_env: dict[str, str]
) -> LaunchPlan:
    node = cluster.nodes[0]
    nproc = node_workers(node, job, facts[node.host])
    argv = _elastic_argv(cluster.python_for(node), ("--standalone",), nproc, job)
    plan = NodePlan(
        host=node.host,
        name=node.name,
        python=cluster.python_for(node),
        nproc=nproc,
        local_addr=None,
        iface=None,
        is_host=True,
        argv=argv,
        env=_worker_env(cluster, facts[node.host], nproc, job),
    )
    return LaunchPlan(
        job_id=job.job_id,
        rdzv_endpoint=None,
        world_size=nproc,
        nodes=(plan,),
        workdir=cluster.workdir,
        grace=job.grace,
        secret_env=secret_env,
        name=job.name,
        what=job.what(),
        kind=job.kind,
        warnings=crowded_nodes(cluster, job, facts),
    )


def crowded_nodes(
    cluster: ClusterSpec, job: JobSpec, facts: Mapping[str, NodeFacts]
) -> tuple[str, ...]:
    """A warning for the nodes without GPUs where more workers than CPU cores were asked for:
    the job starts, but its workers fight over the cores (and a typo such as --nproc 64 on a
    laptop goes unnoticed until the machine crawls). The fix names where the number came from.
    Nodes with the same numbers and fix share one warning, as a hostlist (a thousand identical
    nodes: one line, not a thousand)."""
    alike: dict[tuple[int, int, str], list[str]] = {}
    for node in cluster.nodes:
        node_facts = facts.get(node.host)
        if node_facts is None or node_facts.gpu_count or not node_facts.cpu_count:
            continue
        nproc, cores = node_workers(node, job, node_facts), node_facts.cpu_count
        if nproc <= cores:
            continue
        if job.nproc:
            fix = f"--nproc {cores} (or fewer)"
        elif node.nproc:
            fix = f"nproc = {cores} (or fewer) for {node.host} in {cluster.source}"
        else:
            fix = f"--nproc {cores}"
        alike.setdefault((nproc, cores, fix), []).append(node.host)
    return tuple(
        f"{compress_hostlist(hosts)}{f' ({len(hosts)} nodes)' if len(hosts) > 1 else ''}: "
        f"{nproc} workers on {cores} CPU core(s) and no GPU: the workers will fight over the "
        f"cores; fix: {fix}"
        for (nproc, cores, fix), hosts in alike.items()
    )


def _elastic_argv(
    python: str, rendezvous: tuple[str, ...], nproc: int, job: JobSpec
) -> tuple[str, ...]:
    """torchrun (through herd's wrapper) with the given rendezvous arguments."""
    return (
        python,
        "-m",
        "torchherd.agent.elastic",
        *rendezvous,
        f"--nproc-per-node={nproc}",
        # Restarts are herd's (every node, fresh rendezvous), never torchrun's: torchrun counts
        # restarts per node, so after one node restarts its workers the nodes can disagree on
        # the store prefix of the new attempt and hang or reach dead workers.
        "--max-restarts=0",
        "--tee=3",
        *(("--no-python",) if job.no_python else ()),
        *_entry_args(job),
    )


def rendezvous_id(job: JobSpec) -> str:
    """Unique per job and per attempt, so a restart never meets the state of the last one."""
    return job.job_id if job.attempt == 0 else f"{job.job_id}-r{job.attempt}"


def _worker_env(cluster: ClusterSpec, facts: NodeFacts, nproc: int, job: JobSpec) -> dict[str, str]:
    """The cluster's env plus a fair share of CPU threads per worker, and on a node without a
    GPU the switch that makes Accelerate scripts distributed.

    torchrun sets OMP_NUM_THREADS=1 (with a warning) when several workers share a node, which
    starves CPU workers; the node's cores divided among its workers is as safe and faster.
    """
    env = dict(cluster.env)
    # torchrun's TORCHELASTIC_RESTART_COUNT stays 0 (herd restarts, not torchrun): this says.
    env[ATTEMPT_VAR] = str(job.attempt)
    if facts.gpu_count:
        for name, value in GPU_EVIDENCE.items():
            if name not in env and name not in facts.env:
                env[name] = value
    if "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in facts.env:
        env["OMP_NUM_THREADS"] = str(max(1, facts.cpu_count // nproc))
    if facts.gpu_count == 0 and ACCELERATE_CPU not in env and ACCELERATE_CPU not in facts.env:
        # Accelerate (and the HF Trainer through it) treats a torchrun environment as one
        # distributed job on CPUs only with this set, as its own `accelerate launch --cpu` does;
        # without it every worker trains alone, silently. (An env_file value still wins: the
        # agent applies secrets last.)
        env[ACCELERATE_CPU] = "1"
    env.update(job.env)  # --env on the command line wins over [cluster] env and herd's own
    if job.name:
        env[JOB_NAME_VAR] = job.name
    return env


def _entry_args(job: JobSpec) -> tuple[str, ...]:
    if not job.entry:
        raise ConfigError("nothing to run", "give a script (herd launch train.py) or -m MODULE")
    return ("--module", *job.entry) if job.module else job.entry


def node_workers(node: NodeSpec, job: JobSpec, facts: NodeFacts) -> int:
    """Workers a node runs: --nproc, else its nproc, else its GPU count, else 1."""
    return job.nproc or node.nproc or facts.gpu_count or 1


def _rendezvous_address(cluster: ClusterSpec, facts: NodeFacts) -> str:
    """Where every node reaches the store: the first node's addr, else where ssh reached it."""
    first = cluster.rendezvous_node
    addr = first.addr or facts.ssh_server_addr
    if addr is None:
        raise ConfigError(
            f"cannot tell which address the other nodes should use to reach {first.host}",
            f'set addr = "<its address>" in the first [[node]] of {cluster.source}',
        )
    if ipaddress.ip_address(addr).is_loopback and len(cluster.nodes) > 1:
        raise ConfigError(
            f"{first.host} was reached at {addr}, a loopback address the other nodes cannot use",
            f'set addr = "<its LAN address>" in the first [[node]] of {cluster.source}',
        )
    return addr


def _address_and_iface(
    node: NodeSpec, facts: NodeFacts, rdzv_addr: str, is_host: bool
) -> tuple[str, str | None]:
    if is_host:
        local_addr = node.addr or rdzv_addr
        own = facts.interface_with(local_addr)
        return local_addr, node.iface or (own.name if own else None)
    route = facts.route_to(rdzv_addr)
    if node.addr:
        own = facts.interface_with(node.addr)
        return node.addr, node.iface or (own.name if own else (route[0] if route else None))
    if route is None:
        raise NodeNotReady(
            f"{node.host} has no route to the rendezvous address {rdzv_addr}",
            f"give {node.host} an addr (and iface) in the cluster file, or fix its network; "
            "`herd doctor` shows its interfaces and routes",
            hosts=(node.host,),
        )
    iface, source = route
    return source, node.iface or iface
