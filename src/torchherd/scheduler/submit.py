"""Submitting a rendered job script (sbatch / qsub), and what `herd ps` shows of submitted jobs.

Each submission leaves a record under ~/.herd/submitted/ (the script beside it), so `herd ps`
can list the job with the scheduler's own state: squeue, else sacct (Slurm); ``qstat -f -F json``
(PBS), where a job missing from qstat is "unknown", never "done".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError, HerdError
from ..records import herd_home
from .jobid import JobId, parse_qsub_output, parse_sbatch_output
from .render import Scheduler
from .validate import NAME, check

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]
SUBMIT_COMMAND = {"slurm": "sbatch", "pbs": "qsub"}


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60)


@dataclass
class SubmittedJob:
    scheduler: str
    job_id: str
    name: str
    script: str
    workdir: str
    submitted: float

    def save(self) -> None:
        directory = submitted_dir()
        directory.mkdir(parents=True, exist_ok=True)
        safe = self.job_id.replace("/", "_")
        (directory / f"{self.scheduler}-{safe}.json").write_text(json.dumps(asdict(self)))


def submitted_dir() -> Path:
    return herd_home() / "submitted"


def list_submitted() -> list[SubmittedJob]:
    directory = submitted_dir()
    if not directory.is_dir():
        return []
    found = []
    for path in directory.glob("*.json"):
        try:
            found.append(SubmittedJob(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(found, key=lambda job: job.submitted)


def script_path(scheduler: Scheduler, name: str) -> Path:
    """Where a new script is kept: a chained PBS job resubmits this very file. The name must
    be one the scheduler accepts (validate.NAME: no '/', no '..', no white space)."""
    check("--name", name, NAME, scheduler)
    directory = submitted_dir()
    directory.mkdir(parents=True, exist_ok=True)
    suffix = "sbatch" if scheduler == "slurm" else "pbs"
    return directory / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.{suffix}"


def submit(
    scheduler: Scheduler, script: Path, name: str, workdir: str, run: Runner = _run
) -> JobId:
    """Submit ``script``; its job id. HerdError with the scheduler's message when refused."""
    command = SUBMIT_COMMAND[scheduler]
    if shutil.which(command) is None and run is _run:
        raise ConfigError(
            f"{command} is not on PATH: cannot submit to {scheduler}",
            "run herd submit on a login node of the cluster (or load the scheduler's module); "
            "--dry-run prints the script",
        )
    argv = [command, "--parsable", str(script)] if scheduler == "slurm" else [command, str(script)]
    done = run(argv)
    if done.returncode != 0:
        raise HerdError(
            f"{command} refused the job: {(done.stderr or done.stdout).strip()}",
            "fix the option it names (herd submit --dry-run shows the script)",
        )
    job = (
        parse_sbatch_output(done.stdout) if scheduler == "slurm" else parse_qsub_output(done.stdout)
    )
    SubmittedJob(scheduler, job.text, name, str(script), workdir, time.time()).save()
    return job


def follow_hint(scheduler: str, job_id: str, output: str) -> str:
    if scheduler == "slurm":
        return f"follow it: squeue -j {job_id}; tail -f {output}; herd ps"
    return f"follow it: qstat -f {job_id}; herd ps (output arrives when the job ends)"


def scheduler_states(jobs: Sequence[SubmittedJob], run: Runner = _run) -> dict[str, str]:
    """job id -> the scheduler's state for each job (``unknown`` where it cannot say)."""
    states: dict[str, str] = {}
    slurm = [job.job_id for job in jobs if job.scheduler == "slurm"]
    pbs = [job.job_id for job in jobs if job.scheduler == "pbs"]
    if slurm and shutil.which("squeue") or (slurm and run is not _run):
        states.update(slurm_states(slurm, run))
    if pbs and shutil.which("qstat") or (pbs and run is not _run):
        states.update(pbs_states(pbs, run))
    return {job.job_id: states.get(job.job_id, "unknown") for job in jobs}


def slurm_states(ids: Sequence[str], run: Runner = _run) -> dict[str, str]:
    states: dict[str, str] = {}
    # --states=all: squeue leaves out ended jobs otherwise (it keeps them MinJobAge seconds).
    done = run(["squeue", "-h", "--states=all", "-j", ",".join(ids), "-o", "%i %T"])
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    missing = [i for i in ids if i not in states]
    if missing and shutil.which("sacct") or (missing and run is not _run):
        done = run(["sacct", "-n", "-X", "-P", "-j", ",".join(missing), "-o", "JobID,State"])
        if done.returncode == 0:
            for line in done.stdout.splitlines():
                job, _, state = line.partition("|")
                if job in missing and state:
                    states[job] = state.split()[0]
    return states


def pbs_states(ids: Sequence[str], run: Runner = _run) -> dict[str, str]:
    done = run(["qstat", "-f", "-F", "json", *ids])
    try:
        data = json.loads(done.stdout or "{}")
    except ValueError:
        return {}
    letters = {"Q": "QUEUED", "R": "RUNNING", "H": "HELD", "E": "EXITING", "F": "FINISHED"}
    states = {}
    for job_id, info in (data.get("Jobs") or {}).items():
        letter = str(info.get("job_state", ""))
        states[job_id] = letters.get(letter, letter or "unknown")
    return states
