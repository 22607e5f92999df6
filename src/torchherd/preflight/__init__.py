"""Preflight: checks over what the nodes said about themselves -> a PreflightReport.

It reports; it does not decide. ``run_checks`` judges everything the doctor gathered;
``fast_checks`` judges the quick probe every launch runs (python/torch, versions, rendezvous
port, workdir, the job's script or module), and `herd launch` refuses to start when one of
those fails.

    findings (facts, ssh and probe failures, TCP tests) -> run_checks -> PreflightReport
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..facts import NodeFacts
from ..spec import ClusterSpec, NodeSpec
from . import checks, network_checks, storage_checks
from .environment import cuda_driver, environment
from .findings import (
    Findings,
    Limits,
    NetworkFindings,
    PathOnNode,
    PlanOutcome,
    ProbeFailure,
    StorageFindings,
    plan_for,
)
from .report import BusBandwidth, CheckResult, Link, PreflightReport, Status
from .versions import differences, versions

NodeCheck = Callable[[NodeSpec, Findings, PlanOutcome], CheckResult]


@dataclass(frozen=True)
class Check:
    """A column of the doctor's table."""

    id: str
    header: str
    """Short column title."""
    about: str
    """What it checks, for the legend and --help."""
    optional: bool = False
    """A column shown only when the check ran (``storage``: only with ``--path``)."""


CHECKS: tuple[Check, ...] = (
    Check("ssh", "ssh", "ssh reachability and key authentication"),
    Check("python", "py", "the node's python runs the torchherd agent"),
    Check("torch", "torch", "torch imports (and sees the GPUs, if any)"),
    Check("versions", "vers", "python minor, torch, CUDA, NCCL, torchherd equal on all nodes"),
    Check("environment", "env", "every installed package the same on all nodes (one hash)"),
    Check(
        "driver",
        "drv",
        "the NVIDIA driver runs the CUDA build of the lock's torch (env_lock, env_sync)",
        optional=True,
    ),
    Check("workdir", "wdir", "the working directory exists"),
    Check("workers", "nproc", "workers fit the node's GPUs (or CPU cores)"),
    Check("gpus", "gpus", "GPUs free of other processes"),
    Check("rendezvous", "rdzv", "store port free, private and reachable from every node"),
    Check("ports", "ports", "ephemeral TCP ports reachable between nodes (NCCL/Gloo)"),
    Check("nic", "nic", "the NIC NCCL/Gloo would use is a real network NIC"),
    Check("hostname", "name", "the node's own name does not resolve to loopback"),
    Check("disk", "disk", "free disk and write speed where the job writes"),
    Check(
        "storage",
        "store",
        "each --path exists, is writable and is the same storage on every node",
        optional=True,
    ),
    Check("credentials", "creds", "credential files not readable by other users"),
    Check("network", "net", "link throughput and latency from the rendezvous node"),
)


def _node_checks() -> list[NodeCheck]:
    def plain(check: Callable[[NodeSpec, Findings], CheckResult]) -> NodeCheck:
        return lambda node, findings, outcome: check(node, findings)

    return [
        plain(checks.ssh),
        plain(checks.python),
        plain(checks.torch),
        plain(checks.workdir),
        plain(checks.workers),
        plain(checks.gpus_busy),
        network_checks.rendezvous,
        plain(network_checks.ephemeral_ports),
        checks.nic,
        checks.hostname,
        plain(checks.disk),
        plain(checks.credentials),
        plain(network_checks.link_speed),
    ]


def run_checks(findings: Findings) -> list[CheckResult]:
    """Every check on every node, in table order (node, then check)."""
    outcome = plan_for(findings.cluster, findings.facts, findings.nproc)
    by_node: dict[str, list[CheckResult]] = {n.host: [] for n in findings.cluster.nodes}
    for node in findings.cluster.nodes:
        by_node[node.host] = [check(node, findings, outcome) for check in _node_checks()]
    cluster_wide = (
        versions(findings)
        + environment(findings)
        + cuda_driver(findings)
        + storage_checks.storage(findings)
    )
    for result in cluster_wide:
        by_node[str(result.host)].append(result)
    order = {check.id: index for index, check in enumerate(CHECKS)}
    results = []
    for node in findings.cluster.nodes:
        results += sorted(by_node[node.host], key=lambda r: order.get(r.check, len(order)))
    return results


def make_report(
    findings: Findings,
    *,
    extra: tuple[CheckResult, ...] = (),
    collective: tuple[BusBandwidth, ...] = (),
    seconds: float = 0.0,
) -> PreflightReport:
    """Run the checks and wrap them with cluster-wide results, the version table and raw facts."""
    facts = {
        host: {
            **f.extra,
            "python": f.python,
            "python_version": f.python_version,
            "hostname": f.hostname,
            "cpu_count": f.cpu_count,
            "gpu_count": f.gpu_count,
            "torch_version": f.torch_version,
            "torchherd_version": f.torchherd_version,
        }
        for host, f in findings.facts.items()
    }
    return PreflightReport(
        hosts=tuple(n.host for n in findings.cluster.nodes),
        results=tuple(run_checks(findings)) + extra,
        versions=differences(findings),
        links=findings.network.links if findings.network else (),
        collective=collective,
        facts=facts,
        seconds=seconds,
    )


def fast_checks(
    cluster: ClusterSpec, facts: Mapping[str, NodeFacts], joining: tuple[str, ...] = ()
) -> list[CheckResult]:
    """What every launch checks on the quick probe: torch, versions, workdir, the job's script
    or module on every node, and the rendezvous node's port and exposure (no public address
    unless allowed). The same checks admit a node into a running job (``joining``: such
    nodes are held to the others' versions)."""
    findings = Findings(cluster=cluster, facts=facts, full_probe=False)
    results = []
    for node in cluster.nodes:
        results += [
            checks.torch(node, findings),
            checks.workdir(node, findings),
            checks.entry(node, findings),
        ]
    results += versions(findings, joining)
    results += environment(findings)
    first = cluster.rendezvous_node
    first_facts = facts.get(first.host)
    if cluster.transport != "local" and first_facts is not None:
        exposed = network_checks.rendezvous_exposure(cluster, first, first_facts)
        if exposed is not None:
            results.append(exposed)
    if cluster.transport != "local" and first_facts is not None and first_facts.port_free is False:
        results.append(
            CheckResult(
                "rendezvous",
                first.host,
                Status.FAIL,
                f"rendezvous port {first_facts.port} is in use",
                "set [cluster] rdzv_port to a free port, or leave it out to let herd pick one",
            )
        )
    # Only the launcher's own version differing is no reason to refuse a launch.
    return [r for r in results if not (r.check == "versions" and r.status is Status.WARN)]


__all__ = [
    "CHECKS",
    "BusBandwidth",
    "Check",
    "CheckResult",
    "Findings",
    "Limits",
    "Link",
    "NetworkFindings",
    "PathOnNode",
    "PreflightReport",
    "ProbeFailure",
    "Status",
    "StorageFindings",
    "fast_checks",
    "make_report",
    "plan_for",
    "run_checks",
]
