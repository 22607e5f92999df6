"""`herd bench scaling`: the same work on 1, 2, 4, ... N nodes, as herd jobs.

Weak scaling: every rank does the same number of steps, so a cluster that scales perfectly
delivers N times the throughput of one node. Per node count we report throughput, per-node
efficiency (throughput / (nodes x the 1-node throughput)) and, for the reference model, the
share of step time spent waiting on communication (`bench.scaling_job`). With ``--script`` the
user's own script runs instead, as a fixed amount of work per rank: its wall time per run
(start-up included) gives the throughput in runs per hour, counted per node (N nodes that
each finish their share in the 1-node time deliver N runs' worth), and the communication share
is not known.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError, JobFailed
from ..spec import ClusterSpec
from .job import run_measuring_job
from .markers import SCALING as MARKER

MODULE = "torchherd.bench.scaling_job"
Say = Callable[[str], None]


@dataclass(frozen=True)
class ScalingOptions:
    steps: int = 20
    """Timed training steps per rank at every node count."""
    batch: int = 64
    """Samples per rank per step (reference model)."""
    width: int = 1024
    """Hidden width of the reference MLP (its gradients are what the all-reduce moves)."""
    script: str | None = None
    """Run this script (with ``script_args``) instead of the reference model."""
    script_args: tuple[str, ...] = ()
    nproc: int | None = None
    """Workers per node (default: as `herd launch` would start)."""
    max_nodes: int | None = None
    """Stop at this many nodes (default: all)."""


@dataclass(frozen=True)
class ScalingPoint:
    nodes: int
    world_size: int | None
    """Ranks in the job (not known for a script)."""
    seconds: float
    """Timed steps (reference model) or the whole run (script)."""
    throughput: float
    efficiency: float
    """throughput / (nodes x the 1-node throughput); 1.0 is perfect scaling."""
    comm_share: float | None
    """Share of step time waiting on communication (reference model only)."""


@dataclass(frozen=True)
class ScalingResult:
    workload: str
    unit: str
    points: tuple[ScalingPoint, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "unit": self.unit,
            "points": [asdict(p) for p in self.points],
        }


def node_counts(total: int) -> list[int]:
    """1, 2, 4, ... below ``total``, then ``total`` itself."""
    if total < 1:
        raise ValueError(f"need at least one node, not {total}")
    counts = []
    count = 1
    while count < total:
        counts.append(count)
        count *= 2
    return [*counts, total]


def efficiency(throughput: float, nodes: int, one_node: float) -> float:
    """Per-node efficiency against one node: 1.0 when N nodes deliver N times as much."""
    if nodes < 1 or one_node <= 0:
        raise ValueError("efficiency needs nodes >= 1 and a positive 1-node throughput")
    return throughput / (nodes * one_node)


def comm_share(step_seconds: float, compute_seconds: float) -> float:
    """Share of the step time not explained by compute alone (clamped to 0..1)."""
    if step_seconds <= 0:
        return 0.0
    return min(1.0, max(0.0, (step_seconds - compute_seconds) / step_seconds))


def bench_scaling(
    cluster: ClusterSpec, options: ScalingOptions | None = None, say: Say | None = None
) -> ScalingResult:
    """Run the workload on growing prefixes of the cluster's nodes (the rendezvous node first)."""
    options = options or ScalingOptions()
    say = say or (lambda _: None)
    if options.steps < 1 or options.batch < 1 or options.width < 1:
        raise ConfigError("--steps, --batch and --width must be at least 1", "give positive values")
    total = min(len(cluster.nodes), options.max_nodes or len(cluster.nodes))
    counts = node_counts(total)
    raw: list[tuple[int, int | None, float, float, float | None]] = []
    for count in counts:
        say(f"scaling: {count} of {total} node(s)")
        hosts = [n.host for n in cluster.nodes[:count]]
        raw.append(_run_point(cluster.select(hosts), count, options))
    one = raw[0][3]
    points = tuple(
        ScalingPoint(
            nodes=count,
            world_size=world,
            seconds=seconds,
            throughput=throughput,
            efficiency=efficiency(throughput, count, one),
            comm_share=share,
        )
        for count, world, seconds, throughput, share in raw
    )
    if options.script:
        return ScalingResult(f"script {options.script}", "node-runs/h", points)
    return ScalingResult(
        f"reference MLP (width {options.width}, batch {options.batch}/rank, {options.steps} steps)",
        "samples/s",
        points,
    )


def _run_point(
    cluster: ClusterSpec, count: int, options: ScalingOptions
) -> tuple[int, int | None, float, float, float | None]:
    entry: Sequence[str]
    if options.script:
        entry = (options.script, *options.script_args)
        done = run_measuring_job(cluster, entry, MARKER, module=False, nproc=options.nproc)
        if done.result.exit_code != 0:
            why, remedy = done.why_not()
            raise JobFailed(f"the script failed on {count} node(s): {why}", remedy)
        seconds = done.result.duration
        return count, None, seconds, count * 3600 / seconds, None
    entry = (
        MODULE,
        "--steps",
        str(options.steps),
        "--batch",
        str(options.batch),
        "--width",
        str(options.width),
    )
    done = run_measuring_job(cluster, entry, MARKER, nproc=options.nproc)
    if not done.ok or done.answer is None:
        why, remedy = done.why_not()
        raise JobFailed(f"the scaling job failed on {count} node(s): {why}", remedy)
    answer = done.answer
    seconds = float(answer["seconds"])
    return (
        count,
        int(answer["world_size"]),
        seconds,
        float(answer["samples_per_s"]),
        comm_share(seconds, float(answer["compute_seconds"])),
    )
