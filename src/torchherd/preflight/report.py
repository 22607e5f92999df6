"""The result types of preflight: one CheckResult per node and check, gathered in a report.

Preflight reports; it does not decide. `herd doctor` renders the report and exits 3 when a check
failed; `herd launch` refuses to start on a failed fast check unless told not to. Both decisions
are the caller's, made from the same values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from ..errors import EXIT_NODE_NOT_READY, EXIT_OK


class Status(StrEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"
    """Not run: the node was not reachable, or the check does not apply to it."""


@dataclass(frozen=True)
class CheckResult:
    """What one check found on one node (``host`` None: about the cluster as a whole)."""

    check: str
    host: str | None
    status: Status
    summary: str
    """One line: what was found."""
    remedy: str = ""
    """One line: what to do about it (for warn and fail)."""
    data: Mapping[str, Any] = field(default_factory=dict)
    """Numbers behind the summary, for --json."""

    def line(self) -> str:
        """``host: summary; fix: remedy``: the form launch's problem list and logs use."""
        text = f"{self.host}: {self.summary}" if self.host else self.summary
        return f"{text}; fix: {self.remedy}" if self.remedy else text


@dataclass(frozen=True)
class Link:
    """One TCP test from ``src`` to ``dst``: did it connect, and how fast was it."""

    src: str
    dst: str
    addr: str
    port: int
    purpose: str
    """rdzv (the store port on the rendezvous node) or ephemeral (a kernel-chosen port)."""
    ok: bool
    error: str = ""
    reason: str = ""
    """timeout, refused, unreachable, error, or listen (the listener itself failed)."""
    connect_ms: float | None = None
    rtt_ms: float | None = None
    gbits: float | None = None
    throughput_error: str = ""

    def describe(self) -> str:
        return f"{self.src} -> {self.dst}"


SLOW_GAP = 2.0
"""Slow links are those below the widest gap in the sorted speeds, if it is at least this ratio."""


def slow_links(links: Sequence[Link], gap: float = SLOW_GAP) -> list[Link]:
    """Measured links clearly slower than the rest, slowest first.

    The speeds are sorted and split at the widest ratio between neighbours; when that ratio
    is at least ``gap`` the links below it are slow. Unlike a fixed fraction of the fastest or
    the median, this holds whether the slow links are a few or most of them (a slow node in a
    3-node cluster is on 4 of the 6 directed links), and noise among healthy links does not
    split them (their speeds sit close together)."""
    measured = sorted(
        (x for x in links if x.gbits is not None and x.src != x.dst), key=lambda x: x.gbits or 0.0
    )
    best, cut = 0.0, 0
    for index in range(len(measured) - 1):
        low, high = measured[index].gbits or 0.0, measured[index + 1].gbits or 0.0
        ratio = high / low if low > 0 else float("inf") if high > 0 else 1.0
        if ratio > best:
            best, cut = ratio, index + 1
    return measured[:cut] if best >= gap else []


def shared_slow_node(links: Sequence[Link], gap: float = SLOW_GAP) -> str | None:
    """The one node that every clearly slow link touches: its NIC, cable or port is the likely
    cause. None when nothing is slow, or when the slow links do not point at one node (a single
    slow pair cannot say which of its two ends is to blame)."""
    slow = slow_links(links, gap)
    if not slow:
        return None
    common = set.intersection(*({x.src, x.dst} for x in slow))
    return common.pop() if len(common) == 1 else None


@dataclass(frozen=True)
class BusBandwidth:
    """One message size of the all-reduce test (nccl-tests' definitions)."""

    size_bytes: int
    seconds: float
    algbw_gbytes: float
    busbw_gbytes: float
    """algbw x 2(n-1)/n: comparable with link speed whatever the world size."""
    correct: bool = True
    """Every rank got the exact sum at this size."""

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> BusBandwidth:
        """A row as the all-reduce job prints it (unknown keys ignored, for older nodes)."""
        return cls(
            size_bytes=int(row["size_bytes"]),
            seconds=float(row["seconds"]),
            algbw_gbytes=float(row["algbw_gbytes"]),
            busbw_gbytes=float(row["busbw_gbytes"]),
            correct=bool(row.get("correct", True)),
        )


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: algbw x 2(n-1)/n. A ring all-reduce moves
    2(n-1)/n of the buffer over each rank's link, so busbw compares with the link speed."""
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, not {world_size}")
    return algbw * 2 * (world_size - 1) / world_size


@dataclass(frozen=True)
class PreflightReport:
    """Everything the doctor found, in node order; rendering and exit codes come from here."""

    hosts: tuple[str, ...]
    results: tuple[CheckResult, ...]
    versions: Mapping[str, Mapping[str, str | None]] = field(default_factory=dict)
    """Only the fields that differ between nodes: field -> host -> value."""
    links: tuple[Link, ...] = ()
    collective: tuple[BusBandwidth, ...] = ()
    facts: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per host, the raw probe answer (for --json and bug reports)."""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return any(r.status is Status.FAIL for r in self.results)

    @property
    def exit_code(self) -> int:
        """0 when nothing failed, 3 (node not ready) otherwise."""
        return EXIT_NODE_NOT_READY if self.failed else EXIT_OK

    def result(self, check: str, host: str | None) -> CheckResult | None:
        for result in self.results:
            if result.check == check and result.host == host:
                return result
        return None

    def problems(self) -> list[CheckResult]:
        """Failures first, then warnings, each group in node order."""
        order = {Status.FAIL: 0, Status.WARN: 1}
        found = [r for r in self.results if r.status in order]
        return sorted(found, key=lambda r: order[r.status])

    def slowest_link(self) -> Link | None:
        measured = [link for link in self.links if link.gbits is not None]
        return min(measured, key=lambda link: link.gbits or 0.0) if measured else None

    def slow_node(self) -> str | None:
        """The node every clearly slow link shares (see `shared_slow_node`), if any."""
        return shared_slow_node(self.links)

    def to_dict(self) -> dict[str, Any]:
        """The machine-readable form `herd doctor --json` prints."""
        slowest = self.slowest_link()
        return {
            "ok": not self.failed,
            "exit_code": self.exit_code,
            "hosts": list(self.hosts),
            "results": [
                {**asdict(r), "status": str(r.status), "data": dict(r.data)} for r in self.results
            ],
            "versions": {name: dict(values) for name, values in self.versions.items()},
            "links": [asdict(link) for link in self.links],
            "slowest_link": asdict(slowest) if slowest else None,
            "slow_node": self.slow_node(),
            "collective": [asdict(row) for row in self.collective],
            "facts": {host: dict(values) for host, values in self.facts.items()},
            "seconds": self.seconds,
        }


def sizes_between(smallest: int, largest: int, factor: int) -> list[int]:
    """smallest, x factor, ... up to largest (always included): nccl-tests -b/-e/-f. Here, not
    in the all-reduce worker: `herd bench` checks its sizes before anything imports torch."""
    if smallest < 4 or largest < smallest or factor < 2:
        raise ValueError(f"bad size range {smallest}..{largest} x{factor}")
    sizes = []
    size = smallest
    while size < largest:
        sizes.append(size)
        size *= factor
    return [*sizes, largest]
