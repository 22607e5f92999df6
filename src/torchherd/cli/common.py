"""Helpers shared by command modules: finding the cluster for a command."""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence

from rich.table import Table

from ..errors import ConfigError
from ..scheduler.detect import cluster_for_allocation, detect_allocation
from ..spec import ClusterSpec, find_cluster, local_cluster, parse_host_list


def cluster_for(
    config: str | None, hosts: str | None = None, *, nproc: int | None = None
) -> ClusterSpec:
    """A Slurm allocation, else a PBS one, else -c FILE, or -H h1:4,h2:2, or ./herd.toml, or
    this machine alone (see scheduler/detect.py). Says on stderr when it found an allocation."""
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


def result_table(columns: Sequence[str], right: Collection[str] = ()) -> Table:
    """The borderless table every command prints its per-node results in; ``right``: the
    columns of numbers, aligned right."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left")
    return table
