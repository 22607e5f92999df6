"""`herd doctor --collective`: a real all-reduce across all nodes, through the same path as
`herd launch` (plan, agents, torchrun, c10d), so it fails exactly where a training job would.

The launcher never imports torch: the job is the module ``torchherd.preflight.allreduce``,
imported by the nodes' own torchherd; its result comes back as one line of the job's output.
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

from ..errors import HerdError
from ..logs import RunResult
from ..plan import JobSpec
from ..spec import ClusterSpec
from .report import BusBandwidth, CheckResult, Status

MARKER = "HERD_ALLREDUCE "


def run_collective(
    cluster: ClusterSpec, nproc: int | None, seconds: float = 1.0
) -> tuple[CheckResult, tuple[BusBandwidth, ...]]:
    """Launch the all-reduce job and read its bus bandwidth per message size."""
    from ..launch import LaunchOptions, launch

    job = JobSpec(
        entry=("torchherd.preflight.allreduce", "--seconds", str(seconds)),
        module=True,
        nproc=nproc,
        grace=5.0,
    )
    output = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="herd-doctor-") as logs:
        try:
            result = launch(
                cluster,
                job,
                LaunchOptions(log_dir=Path(logs), color=False),
                stream=output,
                err=io.StringIO(),
            )
        except HerdError as exc:
            return CheckResult(
                "collective",
                None,
                Status.FAIL,
                f"the all-reduce job could not start: {exc.message}",
                exc.remedy,
            ), ()
    assert isinstance(result, RunResult)
    return parse_output(output.getvalue(), result)


def parse_output(text: str, result: RunResult) -> tuple[CheckResult, tuple[BusBandwidth, ...]]:
    """The check result and rows from the job's merged output."""
    answer = None
    for line in text.splitlines():
        if MARKER in line:
            try:
                answer = json.loads(line.split(MARKER, 1)[1])
            except ValueError:
                continue
    if result.exit_code != 0 or answer is None:
        failure = result.first_failure
        why = failure.headline() if failure else f"exit code {result.exit_code}"
        remedy = (
            failure.remedy
            if failure and failure.remedy
            else f"see the job's logs ({result.log_dir or 'herd logs ' + result.job_id})"
        )
        return CheckResult(
            "collective", None, Status.FAIL, f"the all-reduce job failed: {why}", remedy
        ), ()
    rows = tuple(BusBandwidth(**row) for row in answer["rows"])
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
