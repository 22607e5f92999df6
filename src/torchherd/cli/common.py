"""Helpers shared by command modules: finding the cluster for a command."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from rich.table import Table

from ..errors import ConfigError
from ..spec import ClusterSpec, find_cluster, local_cluster, parse_host_list


def cluster_for(
    config: str | None, hosts: str | None = None, *, nproc: int | None = None
) -> ClusterSpec:
    """-c FILE, or -H h1:4,h2:2, or ./herd.toml, or this machine alone."""
    if config and hosts:
        raise ConfigError("give either -c FILE or -H HOSTS, not both", "drop one of them")
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
