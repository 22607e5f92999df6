"""After a job saved at a time limit: get it running again, a bounded number of times.

Slurm: ``scontrol requeue $SLURM_JOB_ID`` (the job needs ``--requeue``), counted by
SLURM_RESTART_COUNT. PBS has no requeue a user may ask for: herd submits the job's own script
again with ``qsub -W depend=afterany:$PBS_JOBID``, counted by HERD_REQUEUE_COUNT. Either way the
next allocation runs the same `herd launch`, and the training script resumes from its snapshot.

PBS gives no warning before the walltime (only SIGTERM, then SIGKILL): ``pbs_deadline`` reads the
walltime from ``qstat -f -F json`` and herd signals itself (SIGUSR1, as Slurm's --signal would)
``grace`` seconds before it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence

from ..errors import HerdError
from ..spec import ClusterSpec
from .render import time_seconds
from .submit import Runner, _run

REQUEUE_COUNT_VAR = "HERD_REQUEUE_COUNT"
SCRIPT_VAR = "HERD_JOB_SCRIPT"


def requeue_after_save(
    cluster: ClusterSpec,
    max_requeues: int,
    environ: Mapping[str, str] | None = None,
    run: Runner = _run,
) -> str:
    """Requeue (Slurm) or chain (PBS) the job; one line saying what was done, or why not."""
    environ = os.environ if environ is None else environ
    job = cluster.scheduler_job_id
    if cluster.transport not in ("slurm", "pbs") or not job:
        return "herd: the job saved a snapshot; run the same command again to resume"
    if cluster.transport == "slurm":
        done_count = _int(environ.get("SLURM_RESTART_COUNT"))
        if done_count >= max_requeues:
            return _limit(done_count, max_requeues)
        try:
            result = run(["scontrol", "requeue", job])
        except (OSError, subprocess.SubprocessError) as exc:
            return f"herd: cannot requeue job {job}: {_could_not_run('scontrol', exc)}"
        if result.returncode != 0:
            return f"herd: cannot requeue job {job}: {(result.stderr or result.stdout).strip()}"
        return (
            f"herd: requeued Slurm job {job} (requeue {done_count + 1} of {max_requeues}); "
            "it resumes from the snapshot"
        )
    done_count = _int(environ.get(REQUEUE_COUNT_VAR))
    if done_count >= max_requeues:
        return _limit(done_count, max_requeues)
    script = environ.get(SCRIPT_VAR)
    if not script:
        return (
            "herd: the job saved a snapshot, but its script is unknown (no HERD_JOB_SCRIPT): "
            "submit it again to resume (herd submit keeps the script)"
        )
    argv: Sequence[str] = [
        "qsub",
        "-W",
        f"depend=afterany:{job}",
        "-v",
        f"{REQUEUE_COUNT_VAR}={done_count + 1}",
        script,
    ]
    try:
        result = run(argv)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"herd: cannot resubmit {script}: {_could_not_run('qsub', exc)}"
    if result.returncode != 0:
        return f"herd: cannot resubmit {script}: {(result.stderr or result.stdout).strip()}"
    return (
        f"herd: submitted {result.stdout.strip()} to run after PBS job {job} "
        f"(requeue {done_count + 1} of {max_requeues}); it resumes from the snapshot"
    )


def _could_not_run(command: str, exc: Exception) -> str:
    """Why a scheduler command did not run, in words (a node without the scheduler's client
    tools on its PATH is the usual reason)."""
    if isinstance(exc, FileNotFoundError):
        return f"{command} is not on PATH"
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"{command} did not answer in {exc.timeout:g} s"
    return f"{command} could not run: {exc}"


def _limit(done: int, limit: int) -> str:
    return (
        f"herd: the job saved a snapshot; not requeued: {done} requeue(s) done, "
        f"--max-requeues is {limit}"
    )


def _int(text: str | None) -> int:
    return int(text) if text and text.strip().isdigit() else 0


def _pbs_walltime_left(job: str, run: Runner) -> tuple[float | None, str]:
    """Seconds left of the job's walltime, or None and why qstat could not say."""
    try:
        result = run(["qstat", "-f", "-F", "json", job])
    except (OSError, subprocess.SubprocessError) as exc:
        return None, _could_not_run("qstat", exc)
    try:
        info = next(iter(json.loads(result.stdout)["Jobs"].values()))
        limit = time_seconds(str(info["Resource_List"]["walltime"]))
        used_text = (info.get("resources_used") or {}).get("walltime")
        used = time_seconds(str(used_text)) if used_text else 0
    except (ValueError, KeyError, TypeError, StopIteration, AttributeError, HerdError):
        said = (result.stderr or "").strip().splitlines()
        return None, f"qstat: {said[-1]}" if said else "qstat gave no walltime for it"
    return float(limit - used), ""


def _on_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def pbs_deadline(
    cluster: ClusterSpec,
    grace: float,
    run: Runner = _run,
    say: Callable[[str], None] = _on_stderr,
) -> threading.Timer | None:
    """Under PBS: a started timer that sends this process SIGUSR1 ``grace`` seconds before the
    walltime (herd then saves and stops as on Slurm's warning). None elsewhere, and where the
    walltime cannot be read (then ``say`` tells that no save is armed, and the job runs)."""
    if cluster.transport != "pbs" or not cluster.scheduler_job_id:
        return None
    left, why = _pbs_walltime_left(cluster.scheduler_job_id, run)
    if left is None:
        say(
            f"herd: the walltime of PBS job {cluster.scheduler_job_id} is unknown ({why}): "
            "no snapshot is asked for before the walltime ends the job\n"
            "  fix: make qstat reachable in the job script (load the PBS module) for that"
        )
        return None
    timer = threading.Timer(max(0.0, left - grace), os.kill, (os.getpid(), signal.SIGUSR1))
    timer.daemon = True
    timer.start()
    return timer
