"""Run a measuring module on the nodes as a herd job and read its answer back.

The measurement (all-reduce, training steps) runs where a training job runs: through
`torchherd.launcher.launch.launch()`, so plan, agents, torchrun and c10d are the ones a job
gets, and the launcher never imports torch. Rank 0 prints one line ``<MARKER>{json}``; this
module finds it in the job's merged output.
"""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..plan import JobSpec
from ..results import RunResult
from ..spec import ClusterSpec


@dataclass(frozen=True)
class JobAnswer:
    """How the job ended and what rank 0 reported (None when it printed nothing)."""

    result: RunResult
    answer: dict[str, Any] | None
    output: str

    @property
    def ok(self) -> bool:
        return self.result.exit_code == 0 and self.answer is not None

    def why_not(self) -> tuple[str, str]:
        """(what went wrong, what to do) for a job that gave no answer."""
        failure = self.result.first_failure
        why = failure.headline() if failure else f"exit code {self.result.exit_code}"
        if self.result.exit_code == 0 and self.answer is None:
            why = "the job printed no result"
        remedy = (
            failure.remedy
            if failure and failure.remedy
            else "run `herd doctor --collective` to see what stops a job on these nodes"
        )
        return why, remedy


def read_answer(text: str, marker: str) -> dict[str, Any] | None:
    """The last ``marker{json}`` line of the output (prefixed by host:rank or not)."""
    answer = None
    for line in text.splitlines():
        if marker in line:
            try:
                value = json.loads(line.split(marker, 1)[1])
            except ValueError:
                continue
            if isinstance(value, dict):
                answer = value
    return answer


def run_measuring_job(
    cluster: ClusterSpec,
    entry: Sequence[str],
    marker: str,
    *,
    module: bool = True,
    nproc: int | None = None,
    kind: str = "bench",
) -> JobAnswer:
    """Launch ``entry`` (a module by default) on every node of ``cluster``, wait for its end,
    and return its answer. Raises the launch's HerdError when the job cannot start. ``kind``
    marks the job's record as herd's own (`herd ps` lists it only with --all)."""
    from ..launcher.launch import LaunchOptions, launch

    job = JobSpec(entry=tuple(entry), module=module, nproc=nproc, grace=5.0, kind=kind)
    output = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="herd-bench-") as logs:
        result = launch(
            cluster,
            job,
            LaunchOptions(log_dir=Path(logs), color=False),
            stream=output,
            err=io.StringIO(),
        )
    assert isinstance(result, RunResult)
    text = output.getvalue()
    return JobAnswer(result, read_answer(text, marker), text)
