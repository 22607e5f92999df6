"""`herd bench net`: TCP throughput and latency between every pair of nodes.

The doctor's machinery does the work (one agent session per node, listeners, the plan's
addresses); here every ordered pair is measured, in rounds of disjoint pairs
(`preflight.rounds`), so no two measurements share a NIC and the time grows with N-1 rounds,
not with N^2 links. The result is a matrix: row = sender, column = receiver.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ConfigError, NodeNotReady
from ..preflight.network import NetOptions
from ..preflight.report import Link, shared_slow_node, slow_links
from ..preflight.rounds import both_ways, pair_rounds
from ..spec import ClusterSpec
from ..transport import Transport, for_cluster

Say = Callable[[str], None]


@dataclass(frozen=True)
class NetBenchOptions:
    """How hard `herd bench net` measures each link."""

    seconds: float = 1.0
    """Longest throughput test per link and direction."""
    bytes: int = 1 << 30
    """Most bytes sent per test."""
    pings: int = 20
    """Round trips per link for the latency figure (median)."""


@dataclass(frozen=True)
class NetMatrix:
    """Every ordered pair's throughput and latency, in the cluster's node order."""

    hosts: tuple[str, ...]
    links: tuple[Link, ...]
    rounds: int
    seconds: float
    options: NetBenchOptions = field(default_factory=NetBenchOptions)

    def link(self, src: str, dst: str) -> Link | None:
        return next((x for x in self.links if x.src == src and x.dst == dst), None)

    def measured(self) -> list[Link]:
        return [x for x in self.links if x.gbits is not None]

    def slowest(self, count: int = 3) -> list[Link]:
        """The slowest measured links, slowest first."""
        return sorted(self.measured(), key=lambda x: x.gbits or 0.0)[:count]

    def slow_links(self) -> list[Link]:
        """Links clearly slower than the rest (see `preflight.report.slow_links`)."""
        return slow_links(self.links)

    def slow_node(self) -> str | None:
        """The node every clearly slow link touches, if there is one."""
        return shared_slow_node(self.links)

    def reference_gbits(self) -> float | None:
        """The slowest link: what bounds a ring all-reduce over these nodes."""
        slowest = self.slowest(1)
        return slowest[0].gbits if slowest else None

    def median_gbits(self) -> float | None:
        values = [x.gbits for x in self.measured() if x.gbits is not None]
        return statistics.median(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "hosts": list(self.hosts),
            "rounds": self.rounds,
            "seconds": self.seconds,
            "options": asdict(self.options),
            "links": [
                {
                    "src": x.src,
                    "dst": x.dst,
                    "addr": x.addr,
                    "ok": x.ok,
                    "gbits": x.gbits,
                    "rtt_ms": x.rtt_ms,
                    "error": x.error or x.throughput_error,
                }
                for x in self.links
            ],
            "slowest": [{"src": x.src, "dst": x.dst, "gbits": x.gbits} for x in self.slowest()],
            "slow_node": self.slow_node(),
            "median_gbits": self.median_gbits(),
            "reference_gbits": self.reference_gbits(),
        }


def bench_net(
    cluster: ClusterSpec,
    options: NetBenchOptions | None = None,
    *,
    transport: Transport | None = None,
    say: Say | None = None,
) -> NetMatrix:
    """Measure every ordered pair of nodes; NodeNotReady when a node cannot take part."""
    from ..preflight.doctor import DoctorOptions, gather

    options = options or NetBenchOptions()
    say = say or (lambda _: None)
    if cluster.transport != "ssh" or len(cluster.nodes) < 2:
        raise ConfigError(
            "herd bench net needs a cluster of at least 2 nodes reached over ssh",
            "describe the nodes in herd.toml (`herd init HOST...`) or pass -c FILE / -H HOSTS",
        )
    started = time.monotonic()
    net = NetOptions(
        full=True, both_ways=True, seconds=options.seconds, bytes=options.bytes, pings=options.pings
    )
    findings = asyncio.run(
        gather(
            cluster.with_workdir(),
            DoctorOptions(full=True, net=net),
            transport or for_cluster(cluster),
            say,
        )
    )
    broken = sorted({*findings.unreachable, *findings.probe_failures})
    if broken or findings.network is None:
        why = f"not ready: {', '.join(broken)}" if broken else findings.network_skipped
        raise NodeNotReady(
            f"cannot measure the network: {why}",
            "run `herd doctor` to see what is wrong on those nodes",
            hosts=tuple(broken),
        )
    links = tuple(x for x in findings.network.links if x.purpose == "ephemeral" and x.src != x.dst)
    hosts = tuple(n.host for n in cluster.nodes)
    return NetMatrix(
        hosts=hosts,
        links=links,
        rounds=len(both_ways(pair_rounds(hosts))),
        seconds=time.monotonic() - started,
        options=options,
    )
