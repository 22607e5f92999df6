"""Judging ``herd doctor --path``: one result per node and path, in the ``storage`` column.

A path that is missing or not writable on a node fails there (the job cannot write its
snapshots). A path that is not the same storage everywhere (the writer's token is missing on
some nodes) warns on those nodes, and on the writer too when no other node sees what it wrote:
snapshots saved on one node are then missing on the others, so a restart that puts ranks on
another node resumes from nothing.
"""

from __future__ import annotations

from typing import Any

from ..spec import NodeSpec
from .findings import Findings, PathOnNode, StorageFindings
from .report import CheckResult, Status

_ACCESS_FIX = (
    "make {path} writable for the ssh user on every node (chown/chmod), or mount it read-write"
)


def storage(findings: Findings) -> list[CheckResult]:
    """Every node's result for every checked path (paths in the order given)."""
    return [
        _judge(node, found, findings)
        for found in findings.storage
        for node in findings.cluster.nodes
    ]


def node_local_fix(path: str) -> str:
    return (
        f"mount one shared filesystem (NFS, Lustre, ...) at {path} on every node, use an "
        "s3:// run directory, or keep snapshots on each node with torchherd.train's "
        'snapshot_scope="node"'
    )


def _judge(node: NodeSpec, found: StorageFindings, findings: Findings) -> CheckResult:
    host, path = node.host, found.path

    def result(status: Status, summary: str, remedy: str = "", **extra: object) -> CheckResult:
        return CheckResult(
            "storage", host, status, f"{path}: {summary}", remedy, {"path": path, **extra}
        )

    if found.url:
        return result(
            Status.SKIP,
            "a URL, not a filesystem path: the job reaches it itself (with the credentials "
            "in its environment or env_file), the same from every node",
        )
    here = found.nodes.get(host)
    if here is None:
        why = "not reachable" if host in findings.unreachable else "not probed"
        return result(Status.SKIP, why)
    space = _space(here)
    facts: dict[str, Any] = {
        "resolved": here.path,
        "state": here.state,
        "free_bytes": here.free_bytes,
        "total_bytes": here.total_bytes,
    }
    if here.state == "no-answer":
        hung = "no answer" in here.error
        return result(
            Status.WARN,
            f"not checked: {here.error}" + (" (a hung network filesystem?)" if hung else ""),
            f"check the mount with `herd exec -- ls {path}`" if hung else "see the other checks",
            **facts,
        )
    if here.state == "missing":
        return result(
            Status.FAIL,
            f"{here.path} does not exist on this node",
            f"mount the shared filesystem at {path} on this node, or create it "
            f"(`herd exec -- mkdir -p {path}`)",
            **facts,
        )
    if here.state == "not-a-dir":
        return result(
            Status.FAIL,
            f"{here.path} is not a directory",
            f"point --path and the job's run directory at a directory, not a file ({path})",
            **facts,
        )
    if here.state in ("no-access", "unwritable"):
        return result(
            Status.FAIL,
            f"cannot write in {here.path}: {here.error}",
            _ACCESS_FIX.format(path=path),
            **facts,
        )
    sharing = [h for h, n in found.nodes.items() if h == found.writer or n.seen == "found"]
    others = [h for h, n in found.nodes.items() if n.state == "ok" and h not in sharing]
    facts.update(writer=found.writer, shared_with=sharing, not_shared_with=others)
    limits = findings.limits
    free_gb = (here.free_bytes or 0) / 1e9
    if here.free_bytes is not None and free_gb < 1:
        return result(
            Status.FAIL,
            f"only {free_gb:.2f} GB free in {here.path}",
            f"free space in {path}: snapshots will fail to write",
            **facts,
        )
    alone = host not in sharing or (host == found.writer and len(sharing) == 1 and others)
    if alone:
        if host == found.writer:
            what = f"no other node sees what this node writes there ({', '.join(others)})"
        else:
            differs = " (a different file under that name)" if here.seen == "other-content" else ""
            what = f"not the storage {found.writer} writes to{differs}: node-local here"
        return result(
            Status.WARN,
            f"{what}; snapshots written on one node are missing on the others, so a restart "
            f"that moves ranks to another node resumes from nothing; {space}",
            node_local_fix(path),
            **facts,
        )
    if here.free_bytes is not None and free_gb < limits.min_disk_gb:
        return result(
            Status.WARN,
            f"{space} (below {limits.min_disk_gb:g} GB)",
            f"free space in {path} for snapshots",
            **facts,
        )
    shared = (
        f"shared by all {len(sharing)} nodes"
        if not others and len(sharing) > 1
        else f"shared with {', '.join(h for h in sharing if h != host)}"
        if len(sharing) > 1
        else "writable"
    )
    return result(Status.PASS, f"{shared}; {space}", **facts)


def _space(here: PathOnNode) -> str:
    if here.free_bytes is None:
        return f"free space unknown in {here.path}"
    return f"{here.free_bytes / 1e9:,.1f} GB free in {here.path}"
