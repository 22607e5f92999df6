"""The same environment on every node: the hash of each node's installed distributions
(``agent/envid.py``) must be one value everywhere.

Versions of torch and Python are checked one by one (``versions``); this check catches the
rest (a library one node upgraded, a package one node lacks). The odd nodes out are the ones
whose hash differs from the most common (on a tie, the rendezvous node's); with the full probe
(doctor) the packages that differ are named. The fix is one option, ``herd launch --env-sync``.
"""

from __future__ import annotations

from ..envs.identity import differences
from .findings import Findings
from .report import CheckResult, Status
from .versions import reference

REMEDY = (
    "herd launch --env-sync (syncs the nodes that differ, then starts; or [cluster] "
    "env_sync = true), or `herd env sync` first and [cluster] python = its "
    "ROOT/current/bin/python; `herd env status` lists the packages"
)


def environment(findings: Findings) -> list[CheckResult]:
    """One result per node whose probe reported a hash: fail where it differs."""
    order = [n.host for n in findings.cluster.nodes]
    hashes = {h: findings.facts[h].env_hash for h in order if h in findings.facts}
    expected = reference(hashes, order)
    results = []
    for host in order:
        mine = hashes.get(host)
        if host not in findings.facts:
            results.append(CheckResult("environment", host, Status.SKIP, "not probed"))
            continue
        if mine is None or expected is None:
            results.append(
                CheckResult(
                    "environment",
                    host,
                    Status.SKIP,
                    "no environment hash reported (an older torchherd)",
                )
            )
            continue
        if mine == expected:
            results.append(CheckResult("environment", host, Status.PASS, f"environment {mine}"))
            continue
        same = [h for h in order if hashes.get(h) == expected]
        message = f"environment {mine} here, {expected} on {', '.join(same[:4])}"
        ref_packages = findings.facts[same[0]].extra.get("env_packages")
        my_packages = findings.facts[host].extra.get("env_packages")
        if isinstance(ref_packages, dict) and isinstance(my_packages, dict):
            changes = differences(my_packages, ref_packages)
            shown = "; ".join(changes[:6]) + (
                f"; {len(changes) - 6} more" if len(changes) > 6 else ""
            )
            # `differences(want=mine, have=theirs)` reads "name theirs -> mine"
            message += f" (packages {same[0]} -> here: {shown})"
        results.append(
            CheckResult(
                "environment",
                host,
                Status.FAIL,
                message,
                REMEDY,
                {"hash": mine, "expected": expected},
            )
        )
    return results
