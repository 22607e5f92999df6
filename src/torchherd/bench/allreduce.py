"""`herd bench allreduce`: all-reduce time, algbw and busbw per message size, like nccl-tests'
all_reduce_perf, run as a herd job (plan, agents, torchrun; NCCL on GPUs, Gloo on CPUs).

The work on the nodes is `torchherd.preflight.allreduce` (the module `herd doctor --collective`
runs too), given the sizes here; every size is checked for the exact sum on every rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError, JobFailed
from ..preflight.report import BusBandwidth, sizes_between
from ..spec import ClusterSpec
from .collective import MARKER, MODULE
from .job import run_measuring_job


@dataclass(frozen=True)
class AllreduceOptions:
    """The sizes and time `herd bench allreduce` spends."""

    min_size: int = 1 << 10
    """Smallest message (bytes)."""
    max_size: int = 64 << 20
    """Largest message (bytes)."""
    factor: int = 4
    """Each size is the previous one times this."""
    seconds: float = 0.5
    """Rough time budget per size (the round count follows from it, 3 to 200)."""
    iters: int = 0
    """Timed rounds per size; 0: from the time budget."""
    nproc: int | None = None
    """Workers per node (default: as `herd launch` would start)."""

    def sizes(self) -> list[int]:
        try:
            return sizes_between(self.min_size, self.max_size, self.factor)
        except ValueError as exc:
            raise ConfigError(
                str(exc), "give --min-size >= 4 bytes, --max-size >= --min-size, --factor >= 2"
            ) from None


@dataclass(frozen=True)
class AllreduceResult:
    hosts: tuple[str, ...]
    world_size: int
    backend: str
    correct: bool
    rows: tuple[BusBandwidth, ...]
    seconds: float
    """Wall time of the whole job, start-up included."""

    def peak(self) -> BusBandwidth | None:
        return max(self.rows, key=lambda r: r.busbw_gbytes) if self.rows else None

    def to_dict(self) -> dict[str, Any]:
        peak = self.peak()
        return {
            "hosts": list(self.hosts),
            "world_size": self.world_size,
            "backend": self.backend,
            "correct": self.correct,
            "peak_busbw_gbytes": peak.busbw_gbytes if peak else None,
            "rows": [asdict(row) for row in self.rows],
            "seconds": self.seconds,
        }


def bench_allreduce(
    cluster: ClusterSpec, options: AllreduceOptions | None = None
) -> AllreduceResult:
    """Run the all-reduce job on every node; JobFailed when it fails. Wrong sums come back in
    the result (``correct``), for the caller to report with the numbers."""
    options = options or AllreduceOptions()
    sizes = options.sizes()
    entry = [MODULE, "--sizes", ",".join(map(str, sizes)), "--seconds", str(options.seconds)]
    if options.iters:
        entry += ["--iters", str(options.iters)]
    done = run_measuring_job(cluster, entry, MARKER, nproc=options.nproc)
    if not done.ok or done.answer is None:
        why, remedy = done.why_not()
        raise JobFailed(f"the all-reduce job failed: {why}", remedy)
    answer = done.answer
    result = AllreduceResult(
        hosts=tuple(n.host for n in cluster.nodes),
        world_size=int(answer["world_size"]),
        backend=str(answer["backend"]),
        correct=bool(answer.get("correct")),
        rows=tuple(BusBandwidth.from_dict(row) for row in answer["rows"]),
        seconds=done.result.duration,
    )
    return result
