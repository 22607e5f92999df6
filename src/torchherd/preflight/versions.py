"""Versions across nodes: python minor, torch, CUDA, NCCL, torchherd and torchft must be the same
everywhere (torchft where it is installed: replica groups of different torchft versions disagree
on the quorum's protocol).

A mismatch rarely fails at once: it shows up as a pickling error, a hang in a collective or an
obscure NCCL error minutes in. The odd nodes out are the ones that differ from the most common
value (on a tie, from the rendezvous node), so a table of differences points at what to fix.
A node joining a running job (a spare, a node back) is held to the job's nodes: the reference
is their most common value, never the newcomer's, whatever the cluster's order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from ..facts import NodeFacts
from .checks import torch_facts
from .findings import Findings
from .report import CheckResult, Status

QUICK_FIELDS = ("python", "torch", "torchherd", "torchft")
FULL_FIELDS = ("python", "torch", "cuda", "nccl", "torchherd", "torchft")


def version_row(facts: NodeFacts, full: bool) -> dict[str, str | None]:
    info = torch_facts(facts)
    row: dict[str, str | None] = {
        "python": ".".join(facts.python_version.split(".")[:2]) or None,
        "torch": info.get("version") or facts.torch_version,
        "torchherd": facts.torchherd_version,
        "torchft": facts.extra.get("torchft_version") or None,
    }
    if full:
        row["cuda"] = info.get("cuda")
        row["nccl"] = info.get("nccl")
    return row


def differences(findings: Findings) -> dict[str, dict[str, str | None]]:
    """field -> host -> value, for the fields whose known values differ between nodes."""
    fields = FULL_FIELDS if findings.full_probe else QUICK_FIELDS
    hosts = [n.host for n in findings.cluster.nodes if n.host in findings.facts]
    rows = {h: version_row(findings.facts[h], findings.full_probe) for h in hosts}
    table: dict[str, dict[str, str | None]] = {}
    for name in fields:
        values = {h: rows[h].get(name) for h in hosts}
        # A missing value (no torch, a CPU node's NCCL) is its own check's business.
        if len({v for v in values.values() if v is not None}) > 1:
            table[name] = values
    return table


def reference(values: Mapping[str, str | None], order: list[str]) -> str | None:
    """The most common known value; on a tie, the first node's (the rendezvous node)."""
    counts = Counter(v for v in values.values() if v is not None)
    if not counts:
        return None
    best = max(counts.values())
    for host in order:
        value = values.get(host)
        if value is not None and counts[value] == best:
            return value
    return None


def versions(findings: Findings, joining: tuple[str, ...] = ()) -> list[CheckResult]:
    """One result per probed node: fail where it differs, warn where only the launcher differs.
    ``joining``: nodes that join the others' running job, judged against them."""
    order = [n.host for n in findings.cluster.nodes]
    table = differences(findings)
    results = []
    for host in order:
        facts = findings.facts.get(host)
        if facts is None:
            results.append(CheckResult("versions", host, Status.SKIP, "not probed"))
            continue
        odd = []
        for name, values in table.items():
            members = {h: v for h, v in values.items() if h not in joining}
            expected = reference(members or values, order)
            mine = values.get(host)
            if mine is not None and mine != expected:
                others = [h for h in order if values.get(h) == expected]
                odd.append(f"{name} {mine} here, {expected} on {_hosts(others)}")
        if odd:
            results.append(
                CheckResult(
                    "versions",
                    host,
                    Status.FAIL,
                    "; ".join(odd),
                    "install the same versions on every node (the table below shows them; "
                    "`herd exec -- pip install torch==X torchherd==Y`)",
                    {"differs": [line.split(" ", 1)[0] for line in odd]},
                )
            )
            continue
        row = version_row(facts, findings.full_probe)
        shown = ", ".join(f"{k} {v}" for k, v in row.items() if v)
        if facts.torchherd_version and facts.torchherd_version != findings.launcher_version:
            results.append(
                CheckResult(
                    "versions",
                    host,
                    Status.WARN,
                    f"torchherd {facts.torchherd_version} here, "
                    f"{findings.launcher_version} on this launcher",
                    f"install torchherd {findings.launcher_version} on the nodes, or the nodes' "
                    "version here",
                )
            )
            continue
        results.append(CheckResult("versions", host, Status.PASS, shown))
    return results


def _hosts(hosts: list[str], limit: int = 4) -> str:
    shown = ", ".join(hosts[:limit])
    return shown + (f" and {len(hosts) - limit} more" if len(hosts) > limit else "")
