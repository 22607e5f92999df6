"""Helpers shared by command modules: finding the cluster for a command (the result table is
tables.py's: rich costs a command that prints no table a twentieth of a second to import)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ..errors import ConfigError, UsageError

if TYPE_CHECKING:
    from ..spec import ClusterSpec


def cluster_for(
    config: str | None,
    hosts: str | None = None,
    *,
    nodes: str | None = None,
    nproc: int | None = None,
) -> ClusterSpec:
    """A Slurm allocation, else a PBS one, else -c FILE, or -H h1:4,h2:2, or ./herd.toml, or
    this machine alone (see scheduler/detect.py), narrowed to ``--nodes a,b`` when given. Says
    on stderr when it found an allocation. Every command that reaches nodes takes the same
    three options (-c, -H, --nodes), so they read the same everywhere."""
    return select(_whole_cluster(config, hosts, nproc), nodes)


def _whole_cluster(config: str | None, hosts: str | None, nproc: int | None) -> ClusterSpec:
    # Here, not at the top: pydantic's models cost every command a tenth of a second.
    from ..scheduler.detect import cluster_for_allocation, detect_allocation
    from ..spec import find_cluster, local_cluster, parse_host_list

    if hosts is not None and not hosts.strip(" ,"):
        # `-H "$HOSTS"` with HOSTS unset: running on this machine alone is never what was meant
        raise UsageError(
            "-H is empty (an unset shell variable?)",
            "give hosts like -H gpu1:4,gpu2:4, or leave -H out to use herd.toml or this machine",
        )
    if config and hosts:
        raise ConfigError("give either -c FILE or -H HOSTS, not both", "drop one of them")
    allocation = detect_allocation()
    if allocation is not None:
        if hosts:
            raise ConfigError(
                f"-H {hosts} given inside {allocation.title}: the allocation names the nodes",
                "drop -H (herd uses the allocated nodes), or run outside the allocation",
            )
        print(f"herd: {allocation.describe()}", file=sys.stderr)
        return cluster_for_allocation(allocation, find_cluster(config))
    if hosts:
        return parse_host_list(hosts, source="-H")
    cluster = find_cluster(config)
    return cluster if cluster is not None else local_cluster(nproc)


def select(cluster: ClusterSpec, nodes: str | None) -> ClusterSpec:
    """The cluster narrowed to ``--nodes a,b`` (in the cluster's order)."""
    if nodes is None:
        return cluster
    names = [n.strip() for n in nodes.split(",") if n.strip()]
    if not names:
        raise UsageError("--nodes is empty", "give hosts like --nodes gpu1,gpu2")
    return cluster.select(names)
