"""What `herd bench all` means, in a few lines: a pure judgement over the measured results.

Each part gets a status (``ok``, ``warn``, ``bad`` or ``skipped``) and one sentence; the report
puts them at the top of the page and the overall verdict is the worst of them. The thresholds
are the ones the README explains: a link below 10 Gbit/s is slow for multi-node training (the
doctor's default ``--min-gbits``); TCP gives NCCL/Gloo 30-60 % of the line rate, much less
points at the wrong NIC; weak scaling below 90 % efficiency wastes a tenth of the machines,
below 70 % almost a third.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .allreduce import AllreduceResult
    from .net import NetMatrix
    from .scaling import ScalingResult

SLOW_LINK_GBITS = 10.0
LOW_BUSBW_SHARE = 0.3
GOOD_EFFICIENCY = 0.9
POOR_EFFICIENCY = 0.7

_RANK = {"ok": 0, "skipped": 0, "warn": 1, "bad": 2}


@dataclass(frozen=True)
class Finding:
    part: str
    status: str
    """ok, warn, bad or skipped."""
    text: str


def judge(
    net: NetMatrix | None,
    allreduce: AllreduceResult | None,
    scaling: ScalingResult | None,
    skipped: dict[str, str] | None = None,
) -> list[Finding]:
    """One finding per part, in the order they ran."""
    skipped = skipped or {}
    return [
        _network(net, skipped.get("net")),
        _allreduce(allreduce, net, skipped.get("allreduce")),
        _scaling(scaling, skipped.get("scaling")),
    ]


def overall(findings: list[Finding]) -> tuple[str, str]:
    """(status, headline) of the whole run: the worst part decides."""
    worst = max(findings, key=lambda f: _RANK[f.status], default=None)
    if worst is None or _RANK[worst.status] == 0:
        ran = [f for f in findings if f.status == "ok"]
        return "ok", f"no problem found in {len(ran)} measured part(s)"
    problems = [f.part for f in findings if _RANK[f.status] == _RANK[worst.status]]
    what = "problem" if worst.status == "bad" else "warning"
    return worst.status, f"{what} in {', '.join(problems)}: see below"


def _network(net: NetMatrix | None, why: str | None) -> Finding:
    if net is None:
        return Finding("network", "skipped", f"not measured: {why or 'not run'}")
    slowest = net.slowest(1)
    if not slowest:
        return Finding("network", "bad", "no link could be measured")
    link = slowest[0]
    gbits = link.gbits or 0.0
    text = f"slowest link {link.describe()} at {gbits:.2f} Gbit/s"
    shared = net.slow_node()
    if shared:
        text += f"; the slow links all touch {shared} (its NIC, cable, switch port or MTU)"
    if gbits < SLOW_LINK_GBITS:
        return Finding("network", "warn", f"{text}: below {SLOW_LINK_GBITS:g} Gbit/s")
    return Finding("network", "ok", text)


def _allreduce(result: AllreduceResult | None, net: NetMatrix | None, why: str | None) -> Finding:
    if result is None:
        return Finding("all-reduce", "skipped", f"not measured: {why or 'not run'}")
    if not result.correct:
        return Finding("all-reduce", "bad", "wrong sums: a rank got a result that is not exact")
    peak = result.peak()
    if peak is None:
        return Finding("all-reduce", "bad", "no message size was measured")
    text = (
        f"peak bus bandwidth {peak.busbw_gbytes:.3f} GB/s on {result.world_size} ranks "
        f"({result.backend})"
    )
    link = net.reference_gbits() if net is not None else None
    if not link:
        return Finding("all-reduce", "ok", text)
    share = peak.busbw_gbytes * 8 / link
    text += f", {share:.0%} of the slowest link"
    if share < LOW_BUSBW_SHARE:
        return Finding(
            "all-reduce",
            "warn",
            f"{text}: TCP usually gives 30-60 %; check the NIC NCCL/Gloo use (herd doctor)",
        )
    return Finding("all-reduce", "ok", text)


def _scaling(result: ScalingResult | None, why: str | None) -> Finding:
    if result is None or not result.points:
        return Finding("scaling", "skipped", f"not measured: {why or 'not run'}")
    last = result.points[-1]
    if last.nodes < 2:
        return Finding("scaling", "skipped", "one node only: nothing to compare it with")
    text = f"{last.efficiency:.0%} efficiency on {last.nodes} nodes ({result.workload})"
    if last.comm_share is not None:
        text += f", {last.comm_share:.0%} of step time waiting on communication"
    if last.efficiency < POOR_EFFICIENCY:
        return Finding("scaling", "bad", text)
    if last.efficiency < GOOD_EFFICIENCY:
        return Finding("scaling", "warn", text)
    return Finding("scaling", "ok", text)
