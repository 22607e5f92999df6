"""Benchmark: `herd doctor` on 8 testbed nodes vs on 1 node (target ratio <= 1.5).

The doctor's work per node (ssh, probe, TCP tests) runs in parallel, and its throughput tests
run in a fixed few rounds of disjoint pairs, so eight nodes should cost little more than one.
Measured on the namespace testbed (needs root, like the integration tests), with a delay on
every node's link (default 10 ms: real networks have latency; on a bare veth the shared CPU
dominates and hides what the fan-out costs):

    python bench/doctor.py [--nodes 8] [--repeat 3] [--delay-ms 10]

Two regimes are reported:
  warm  the usual case: each node's probe remembers its torch import (keyed by the install), so
        a run costs ssh, the stdlib probe and the TCP tests;
  cold  --fresh: every node imports torch. All testbed nodes share this machine's CPU cores, so
        N simultaneous imports take about N/cores times as long here; on real machines each node
        imports on its own CPUs. That ratio measures this machine, not the fan-out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.testbed import Testbed, testbed_available  # noqa: E402
from torchherd.preflight.doctor import DoctorOptions, doctor  # noqa: E402
from torchherd.spec import load_cluster_file  # noqa: E402


def timed(path: Path, fresh: bool = False) -> tuple[float, int, dict[str, float]]:
    """Seconds for one doctor run, its exit code, and seconds per stage."""
    cluster = load_cluster_file(path)
    stages: dict[str, float] = {}
    started = last = time.perf_counter()
    current = "connect"

    def say(text: str) -> None:
        nonlocal last, current
        if text.startswith("probing"):
            stage = "probe"
        elif text.startswith(("connecting between", "measuring")):
            stage = "tests"
        else:
            stage = current
        if stage != current:
            now = time.perf_counter()
            stages[current] = stages.get(current, 0.0) + now - last
            current, last = stage, now

    report = doctor(cluster, DoctorOptions(fresh=fresh), say=say)
    ended = time.perf_counter()
    stages[current] = stages.get(current, 0.0) + ended - last
    return ended - started, report.exit_code, stages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--delay-ms", type=int, default=10, help="delay on every node's link (0: none)"
    )
    args = parser.parse_args()
    ok, reason = testbed_available()
    if not ok:
        print(f"bench/doctor.py: no testbed here: {reason}", file=sys.stderr)
        return 1
    with Testbed(args.nodes, hosts_loopback=True) as bed:
        if args.delay_ms > 0:
            for node in bed.nodes:
                bed.delay(node, args.delay_ms)
        many = bed.write_cluster_file(bed.tmp / "many.toml", connect_timeout=5)
        one = bed.write_cluster_file(bed.tmp / "one.toml", nodes=["node1"], connect_timeout=5)
        cold_one, code, _ = timed(one, fresh=True)
        cold_many, code_many, _ = timed(many, fresh=True)
        if code or code_many:
            print(
                f"a doctor run failed (exit {code}, {code_many}); timings would mislead",
                file=sys.stderr,
            )
            return 1
        warm: dict[str, list[float]] = {"one": [], "many": []}
        stages: dict[str, dict[str, float]] = {}
        for _ in range(args.repeat):  # interleaved, so drift on a shared machine hits both
            for name, path in (("one", one), ("many", many)):
                seconds, _, stages[name] = timed(path)
                warm[name].append(seconds)
    one_s, many_s = statistics.median(warm["one"]), statistics.median(warm["many"])
    cores = len(os.sched_getaffinity(0))
    print(
        f"herd doctor, {args.nodes} nodes vs 1 node (testbed, {cores} CPU cores, "
        f"{args.delay_ms} ms delay on every node's link)"
    )
    print(
        f"  warm: 1 node {one_s:.2f} s, {args.nodes} nodes {many_s:.2f} s "
        f"(median of {args.repeat}): ratio {many_s / one_s:.2f} (target <= 1.5)"
    )
    for name, count in (("one", 1), ("many", args.nodes)):
        split = ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in stages[name].items())
        print(f"    {count} node(s), last warm run by stage: {split}")
    print(
        f"  cold: 1 node {cold_one:.2f} s, {args.nodes} nodes {cold_many:.2f} s: "
        f"ratio {cold_many / cold_one:.2f} ({args.nodes} torch imports on {cores} cores)"
    )
    return 0 if many_s / one_s <= 1.5 else 2


if __name__ == "__main__":
    raise SystemExit(main())
