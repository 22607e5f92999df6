"""`herd doctor --collective`: a real all-reduce across all nodes, through the same path as
`herd launch` (plan, agents, torchrun, c10d), so it fails exactly where a training job would.

The launcher never imports torch: the job is the module ``torchherd.preflight.allreduce``,
imported by the nodes' own torchherd; its result comes back as one line of the job's output
(`bench.job`, which `herd bench allreduce` uses too). It lives here, above the launcher, and
not in preflight/ (the checks, below it): the doctor is handed it by its caller.
"""

from __future__ import annotations

from ..errors import HerdError
from ..preflight.report import BusBandwidth, CheckResult, Status
from ..results import RunResult
from ..spec import ClusterSpec
from .job import JobAnswer, read_answer, run_measuring_job

MARKER = "HERD_ALLREDUCE "
MODULE = "torchherd.preflight.allreduce"


def run_collective(
    cluster: ClusterSpec, nproc: int | None, seconds: float = 1.0
) -> tuple[CheckResult, tuple[BusBandwidth, ...]]:
    """Launch the all-reduce job and read its bus bandwidth per message size."""
    try:
        done = run_measuring_job(
            cluster, (MODULE, "--seconds", str(seconds)), MARKER, nproc=nproc, kind="doctor"
        )
    except HerdError as exc:
        return CheckResult(
            "collective",
            None,
            Status.FAIL,
            f"the all-reduce job could not start: {exc.message}",
            exc.remedy,
        ), ()
    return judge(done)


def parse_output(text: str, result: RunResult) -> tuple[CheckResult, tuple[BusBandwidth, ...]]:
    """The check result and rows from the job's merged output."""
    return judge(JobAnswer(result, read_answer(text, MARKER), text))


def judge(done: JobAnswer) -> tuple[CheckResult, tuple[BusBandwidth, ...]]:
    answer = done.answer
    if not done.ok or answer is None:
        why, remedy = done.why_not()
        return CheckResult(
            "collective", None, Status.FAIL, f"the all-reduce job failed: {why}", remedy
        ), ()
    rows = tuple(BusBandwidth.from_dict(row) for row in answer["rows"])
    if not answer.get("correct"):
        return CheckResult(
            "collective",
            None,
            Status.FAIL,
            "the all-reduce returned wrong values",
            "check the nodes' torch/NCCL versions and their network",
        ), rows
    best = max(rows, key=lambda r: r.busbw_gbytes) if rows else None
    peak = f", peak bus bandwidth {best.busbw_gbytes:.2f} GB/s" if best else ""
    return CheckResult(
        "collective",
        None,
        Status.PASS,
        f"all-reduce on {answer['world_size']} ranks ({answer['backend']}) correct{peak}",
        data={"backend": answer["backend"], "world_size": answer["world_size"]},
    ), rows
