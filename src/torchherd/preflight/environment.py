"""The same environment on every node: the hash of each node's installed distributions
(``agent/envid.py``) must be one value everywhere.

Versions of torch and Python are checked one by one (``versions``); this check catches the
rest (a library one node upgraded, a package one node lacks). The odd nodes out are the ones
whose hash differs from the most common (on a tie, the rendezvous node's); with the full probe
(doctor) the packages that differ are named. The fix is one option, ``herd launch --env-sync``.
"""

from __future__ import annotations

import re

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


# The oldest NVIDIA driver that runs builds of each CUDA major (NVIDIA's minor version
# compatibility: a driver that runs 12.0 runs every 12.x build).
MIN_DRIVER = {11: (450, 80), 12: (525, 60), 13: (580, 65)}


def cuda_of(torch_version: str) -> tuple[int, int] | None:
    """``2.13.0+cu128`` -> (12, 8), ``+cu118`` -> (11, 8); None for a CPU (or ROCm) build."""
    found = re.search(r"\+cu(\d+)(\d)$", torch_version)
    return (int(found[1]), int(found[2])) if found else None


def driver_runs(driver: str, cuda: tuple[int, int]) -> bool | None:
    """Whether an NVIDIA driver of this version runs builds for ``cuda``; None if unknown."""
    need = MIN_DRIVER.get(cuda[0])
    parts = re.match(r"(\d+)\.(\d+)", driver)
    if need is None or parts is None:
        return None
    return (int(parts[1]), int(parts[2])) >= need


def cuda_driver(findings: Findings) -> list[CheckResult]:
    """The lock's torch build against each node's NVIDIA driver (the doctor's full probe reads
    it), before any launch: torch's CUDA variant is never changed behind the user's back, so
    a node whose driver is too old is named with the driver it needs. Nothing without a lock
    (``env_torch``) or for a CPU build; a node without a driver is passed over (no GPU)."""
    torch = findings.env_torch
    cuda = cuda_of(torch) if torch else None
    if cuda is None:
        return []
    results = []
    for node in findings.cluster.nodes:
        facts = findings.facts.get(node.host)
        driver = facts.extra.get("driver") if facts is not None else None
        if not isinstance(driver, str):
            status = Status.SKIP
            text = "no NVIDIA driver" if facts is not None else "not probed"
            results.append(CheckResult("driver", node.host, status, text))
            continue
        runs = driver_runs(driver, cuda)
        need = MIN_DRIVER.get(cuda[0], (0, 0))
        build = f"torch {torch} (CUDA {cuda[0]}.{cuda[1]})"
        if runs is False:
            results.append(
                CheckResult(
                    "driver",
                    node.host,
                    Status.FAIL,
                    f"driver {driver} cannot run the lock's {build}: it needs "
                    f"{need[0]}.{need[1]} or newer",
                    f"update the NVIDIA driver on {node.name} to {need[0]}.{need[1]} or "
                    "newer, or lock a torch build for an older CUDA (+cu118 runs on 450.80)",
                    {"driver": driver, "cuda": f"{cuda[0]}.{cuda[1]}"},
                )
            )
        elif runs is None:
            results.append(
                CheckResult("driver", node.host, Status.WARN, f"driver {driver}: {build} unknown")
            )
        else:
            results.append(
                CheckResult("driver", node.host, Status.PASS, f"driver {driver} runs {build}")
            )
    return results
