"""Findings: everything the checks look at, gathered first, judged after.

Gathering does I/O (ssh, probes, TCP tests); judging is a pure function of these values, so every
check can be tested on recorded facts without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import __version__
from ..errors import ConfigError, NodeNotReady
from ..facts import NodeFacts
from ..plan import JobSpec, LaunchPlan, make_plan
from ..spec import ClusterSpec
from ..transport import Unreachable
from .report import Link


@dataclass(frozen=True)
class Limits:
    """Thresholds of the checks that warn rather than fail on a number."""

    min_gbits: float = 10.0
    """Warn on a link slower than this (Gbit/s)."""
    min_disk_gb: float = 10.0
    """Warn below this much free disk where the job writes (GB); fail below 1 GB."""
    min_write_mb_s: float = 50.0
    """Warn when the disk write test is slower than this (MB/s)."""
    busy_utilization: int = 20
    """A GPU this busy (percent) counts as in use by someone else."""


@dataclass(frozen=True)
class ProbeFailure:
    """Why the agent probe could not run on a reachable node."""

    host: str
    python: str
    kind: str
    """no-python, no-torchherd, old-python, timeout, bad-output or error."""
    detail: str
    python_version: str | None = None
    has_torch: bool | None = None
    """From a stdlib-only fallback check, when the interpreter runs but torchherd is missing."""


@dataclass(frozen=True)
class NetworkFindings:
    """The TCP tests: listeners that could not open, and every connection tried."""

    rdzv_host: str
    rdzv_addr: str
    rdzv_port: int
    links: tuple[Link, ...] = ()
    listen_errors: Mapping[tuple[str, str], str] = field(default_factory=dict)
    """(host, rdzv|ephemeral) -> why the listener could not open."""
    full: bool = False
    """All pairs were tested (not only the star around the rendezvous node)."""


@dataclass(frozen=True)
class PathOnNode:
    """What one node found at one checked path (see ``agent/storage.py``)."""

    path: str
    """The path as this node resolved it (``~`` expanded for its user)."""
    state: str
    """ok, missing, not-a-dir, no-access, unwritable, or no-answer (the node did not answer)."""
    error: str = ""
    free_bytes: int | None = None
    total_bytes: int | None = None
    seen: str | None = None
    """Whether the writer's token is here: found, other-content or absent; None when this node
    is the writer or was not asked."""


@dataclass(frozen=True)
class StorageFindings:
    """One ``--path``: what every node found there, and who wrote the token the others sought."""

    path: str
    """As given on the command line."""
    nodes: Mapping[str, PathOnNode] = field(default_factory=dict)
    writer: str | None = None
    """The first node (in cluster order) where the path is a writable directory."""
    url: bool = False
    """An fsspec URL (s3://...): not a filesystem path, not looked at by the nodes."""


@dataclass(frozen=True)
class Findings:
    cluster: ClusterSpec
    facts: Mapping[str, NodeFacts]
    """Probe answers of the nodes that answered."""
    unreachable: Mapping[str, Unreachable] = field(default_factory=dict)
    probe_failures: Mapping[str, ProbeFailure] = field(default_factory=dict)
    network: NetworkFindings | None = None
    network_skipped: str = ""
    """Why the network tests did not run (empty when they did, or never apply)."""
    nproc: int | None = None
    """Workers per node asked on the command line (overrides the cluster file)."""
    limits: Limits = field(default_factory=Limits)
    launcher_version: str = __version__
    full_probe: bool = True
    """Whether the facts come from the full probe (torch imported) or the quick one."""
    storage: tuple[StorageFindings, ...] = ()
    """The paths of ``herd doctor --path``, in the order given."""
    env_torch: str | None = None
    """The torch (with its build label, ``2.13.0+cu128``) of the environment the cluster
    syncs (env_sync, env_lock); None without one."""


@dataclass(frozen=True)
class PlanOutcome:
    """The launch plan for the nodes that answered, or why there is none."""

    plan: LaunchPlan | None
    error: str = ""
    remedy: str = ""
    no_route: Mapping[str, str] = field(default_factory=dict)
    """Nodes left out because they have no route to the rendezvous address: host -> message."""


def plan_for(
    cluster: ClusterSpec, facts: Mapping[str, NodeFacts], nproc: int | None
) -> PlanOutcome:
    """The same plan `herd launch` would make, over the nodes that answered the probe.

    Nodes without a route to the rendezvous address are left out (and named) so the rest still
    get their network checks; no plan at all when the rendezvous node itself did not answer.
    """
    first = cluster.rendezvous_node
    if first.host not in facts:
        return PlanOutcome(
            None,
            f"the rendezvous node {first.host} did not answer the probe",
            "fix it first (see its row)",
        )
    hosts = [n.host for n in cluster.nodes if n.host in facts]
    no_route: dict[str, str] = {}
    job = JobSpec(entry=("herd-doctor",), nproc=nproc, job_id="doctor")
    while True:
        sub = cluster.select(hosts)
        try:
            return PlanOutcome(make_plan(sub, job, facts), no_route=no_route)
        except NodeNotReady as exc:
            dropped = [h for h in exc.hosts if h in hosts and h != first.host]
            if not dropped:
                return PlanOutcome(None, exc.message, exc.remedy, no_route)
            for host in dropped:
                no_route[host] = exc.message
                hosts.remove(host)
        except ConfigError as exc:
            return PlanOutcome(None, exc.message, exc.remedy, no_route)
