"""Job ids of both schedulers, as they are printed and as they appear in the environment.

Slurm: ``1234``, array tasks ``1234_7``, sbatch's ``Submitted batch job 1234`` (or
``1234;cluster`` with --parsable). PBS: ``123.server``, array subjobs ``123[4].server``, array
parents ``123[].server``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import HerdError

_SBATCH = re.compile(r"^\s*(?:Submitted batch job\s+)?(\d+)(?:;\S+)?\s*$", re.MULTILINE)
_SLURM_ID = re.compile(r"^(\d+)(?:_(\d+))?$")
_PBS_ID = re.compile(r"^(\d+)(?:\[(\d*)\])?(?:\.(\S+))?$")


@dataclass(frozen=True)
class JobId:
    """A scheduler's job id, split into its parts; ``text`` is the id as the scheduler prints it."""

    scheduler: str
    text: str
    number: int
    index: int | None = None
    """Array task or subjob index."""
    server: str | None = None
    """PBS server name."""
    array: bool = False
    """A PBS array parent (``123[]``)."""


def parse_slurm_jobid(text: str) -> JobId:
    match = _SLURM_ID.match(text.strip())
    if not match:
        raise HerdError(f"{text!r} is not a Slurm job id", "Slurm job ids look like 1234 or 1234_7")
    index = int(match.group(2)) if match.group(2) else None
    return JobId("slurm", text.strip(), int(match.group(1)), index)


def parse_pbs_jobid(text: str) -> JobId:
    match = _PBS_ID.match(text.strip())
    if not match:
        raise HerdError(
            f"{text!r} is not a PBS job id", "PBS job ids look like 123.server or 123[4].server"
        )
    bracket = match.group(2)
    return JobId(
        "pbs",
        text.strip(),
        int(match.group(1)),
        index=int(bracket) if bracket else None,
        server=match.group(3),
        array=bracket == "",
    )


def parse_sbatch_output(output: str) -> JobId:
    """The job id in what sbatch printed."""
    match = _SBATCH.search(output)
    if not match:
        raise HerdError(
            f"sbatch printed no job id: {output.strip()[-300:]!r}", "see sbatch's message above"
        )
    return parse_slurm_jobid(match.group(1))


def parse_qsub_output(output: str) -> JobId:
    """The job id qsub printed (its only line)."""
    for line in output.splitlines():
        line = line.strip()
        if line:
            return parse_pbs_jobid(line)
    raise HerdError("qsub printed no job id", "see qsub's message above")
