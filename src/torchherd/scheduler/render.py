"""Job scripts for `herd submit`: a Slurm or PBS batch script that runs `herd launch` inside the
allocation, with one agent per node and a warning before the time limit.

Slurm: one task per node, ``--signal=B:USR1@<grace>`` (USR1 to the batch shell only: a raw USR1
to the steps would kill torchrun) and ``--requeue``; ``exec herd launch`` makes herd itself the
batch shell process, so the warning reaches herd, which asks the workers to snapshot, stops them
and requeues the job. PBS has no warning signal: herd computes the deadline from the walltime
(``--time-grace``), and resubmits by a chained ``qsub -W depend=afterany``; ``-r y`` lets PBS
rerun the job after a preemption. ``select=N:ncpus=C:mpiprocs=1:ngpus=G`` with
``place=scatter`` gives one chunk (and one nodefile line) per node.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Literal

from ..errors import UsageError
from .validate import check_submit_values

Scheduler = Literal["slurm", "pbs"]
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")


@dataclass(frozen=True)
class SubmitSpec:
    """What `herd submit` asks the scheduler for, and what the job runs."""

    scheduler: Scheduler
    nodes: int
    """Nodes of the allocation: one agent on each."""
    launch_args: tuple[str, ...]
    """Arguments of `herd launch` (the script and its arguments, options)."""
    herd: tuple[str, ...]
    """How to run herd on the first node (the launcher's own interpreter)."""
    workdir: str
    """Where the job runs (the directory herd submit ran in)."""
    time: str = "01:00:00"
    """Time limit: [D-]HH:MM:SS, MM or HH:MM:SS."""
    gpus_per_node: int = 0
    cpus_per_node: int | None = None
    partition: str | None = None
    """Slurm partition or PBS queue."""
    account: str | None = None
    name: str = "herd"
    grace: int = 120
    """Seconds before the time limit at which herd asks the workers to save and stop."""
    max_requeues: int = 3
    """Times the job is requeued (Slurm) or chained (PBS) after saving at a time limit."""
    gpu_resource: str = "ngpus"
    """PBS only: the site's name of the GPU resource in select=."""
    output: str | None = None
    """Output file; default: herd-<job id>.out in the working directory."""
    script_path: str | None = None
    """Where the script is kept (PBS: a chained job resubmits this file)."""


def time_seconds(text: str) -> int:
    """Slurm/PBS time (``90``, ``1:30:00``, ``2-00:00:00``) in seconds."""
    match = _TIME.match(text.strip())
    if not match:
        raise UsageError(
            f"cannot read the time limit {text!r}", "write it as HH:MM:SS, e.g. --time 02:00:00"
        )
    days, first, second, third = (int(g) if g else None for g in match.groups())
    if second is None:  # "90": minutes (Slurm's reading)
        seconds = (first or 0) * 60
    elif third is None:  # "1:30": hours and minutes with days, else minutes and seconds
        seconds = (
            (first or 0) * 3600 + second * 60 if days is not None else (first or 0) * 60 + second
        )
    else:
        seconds = (first or 0) * 3600 + second * 60 + third
    return seconds + (days or 0) * 86400


def hms(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def render(spec: SubmitSpec) -> str:
    """The job script; UsageError for a value the scheduler would not take (validate.py)."""
    check_submit_values(
        spec.scheduler,
        name=spec.name,
        partition=spec.partition,
        account=spec.account,
        output=spec.output,
        gpu_resource=spec.gpu_resource,
    )
    limit = time_seconds(spec.time)
    if spec.grace >= limit:
        raise UsageError(
            f"the save grace ({spec.grace} s) is not shorter than the time limit ({spec.time})",
            "give a longer --time or a shorter --grace",
        )
    return render_slurm(spec, limit) if spec.scheduler == "slurm" else render_pbs(spec, limit)


def _launch_line(spec: SubmitSpec) -> str:
    argv = [
        *spec.herd,
        "launch",
        f"--max-requeues={spec.max_requeues}",
        f"--time-grace={spec.grace}",
        *spec.launch_args,
    ]
    return "exec " + shlex.join(argv)


def handles_node_loss(launch_args: tuple[str, ...]) -> bool:
    """Whether the job goes on without a lost node (``--min-nodes``) or puts a spare in its
    place (``--spares``): then Slurm must not end the whole job when a node fails
    (``--no-kill``)."""
    options = ("--min-nodes", "--spares")
    return any(a in options or a.split("=", 1)[0] in options for a in launch_args)


def render_slurm(spec: SubmitSpec, limit: int) -> str:
    options = [
        f"--job-name={spec.name}",
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",
    ]
    if spec.cpus_per_node:
        options.append(f"--cpus-per-task={spec.cpus_per_node}")
    if spec.gpus_per_node:
        options.append(f"--gpus-per-node={spec.gpus_per_node}")
    options.append(f"--time={hms(limit)}")
    if spec.partition:
        options.append(f"--partition={spec.partition}")
    if spec.account:
        options.append(f"--account={spec.account}")
    options += [
        f"--signal=B:USR1@{spec.grace}",
        "--requeue",
        "--open-mode=append",
        f"--output={spec.output or 'herd-%j.out'}",
    ]
    goes_on_without_nodes = handles_node_loss(spec.launch_args)
    if goes_on_without_nodes:
        options.append("--no-kill")
    lines = ["#!/bin/bash", *(f"#SBATCH {option}" for option in options)]
    lines += [
        "# Rendered by `herd submit`: herd runs on the first node and starts one agent per node",
        "# with srun. USR1 comes before the time limit: herd saves a snapshot, stops the",
        "# workers and requeues this job, which resumes from the snapshot.",
        "# A lost node: "
        + (
            "--no-kill keeps the allocation, and herd goes on without the node (--min-nodes)"
            " or puts a spare in its place (--spares)."
            if goes_on_without_nodes
            else "Slurm ends the job and requeues it (herd needs every node)."
        ),
        f"cd {shlex.quote(spec.workdir)}",
        _launch_line(spec),
    ]
    return "\n".join(lines) + "\n"


def render_pbs(spec: SubmitSpec, limit: int) -> str:
    chunk = [f"select={spec.nodes}"]
    if spec.cpus_per_node:
        chunk.append(f"ncpus={spec.cpus_per_node}")
    chunk.append("mpiprocs=1")
    if spec.gpus_per_node:
        chunk.append(f"{spec.gpu_resource}={spec.gpus_per_node}")
    options = [
        f"-N {spec.name}",
        "-l " + ":".join(chunk),
        "-l place=scatter",
        f"-l walltime={hms(limit)}",
    ]
    if spec.partition:
        options.append(f"-q {spec.partition}")
    if spec.account:
        options.append(f"-A {spec.account}")
    options += ["-r y", "-j oe"]
    if spec.output:
        options.append(f"-o {spec.output}")
    lines = ["#!/bin/bash", *(f"#PBS {option}" for option in options)]
    lines += [
        "# Rendered by `herd submit`: a PBS script runs on the first node only; herd starts one",
        "# agent on every node of $PBS_NODEFILE. Before the walltime herd saves a snapshot,",
        "# stops the workers and submits this script again, to run after this job.",
        f"cd {shlex.quote(spec.workdir)}",
    ]
    if spec.script_path:
        lines.append(f"export HERD_JOB_SCRIPT={shlex.quote(spec.script_path)}")
    lines.append(_launch_line(spec))
    return "\n".join(lines) + "\n"
