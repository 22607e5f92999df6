"""`herd submit --scheduler slurm|pbs`: a job script that runs `herd launch` in an allocation."""

from __future__ import annotations

import os
import sys

import typer

from ..errors import EXIT_OK, UsageError
from ..scheduler.render import Scheduler, SubmitSpec, render
from ..scheduler.submit import follow_hint, script_path, submit
from .app import app
from .parsing import RUNS_SOMETHING, HerdCommand


@app.command("submit", cls=HerdCommand, context_settings=RUNS_SOMETHING)
def submit_command(
    ctx: typer.Context,
    script: str = typer.Argument(
        None,
        metavar="SCRIPT [ARGS]...",
        help="What `herd launch` runs in the allocation: the training script and its arguments.",
        show_default=False,
    ),
    scheduler: str = typer.Option(
        ..., "--scheduler", "-s", help="slurm (sbatch) or pbs (qsub).", show_default=False
    ),
    nodes: int = typer.Option(..., "--nodes", "-N", min=1, help="Nodes: one agent on each."),
    gpus_per_node: int = typer.Option(
        0, "--gpus-per-node", "-G", min=0, help="GPUs per node (one worker each)."
    ),
    cpus_per_node: int = typer.Option(
        None, "--cpus-per-node", min=1, help="CPUs per node (Slurm cpus-per-task, PBS ncpus)."
    ),
    time_limit: str = typer.Option(
        "01:00:00", "--time", "-t", help="Time limit: HH:MM:SS or D-HH:MM:SS."
    ),
    partition: str = typer.Option(
        None, "--partition", "--queue", "-p", "-q", help="Slurm partition or PBS queue."
    ),
    account: str = typer.Option(None, "--account", "-A", help="Account to charge."),
    name: str = typer.Option("herd", "--name", help="Job name."),
    grace: int = typer.Option(
        120,
        "--grace",
        min=10,
        help="Seconds before the time limit at which the workers save a snapshot and stop.",
    ),
    max_requeues: int = typer.Option(
        3, "--max-requeues", min=0, help="Times the job is requeued after saving at the limit."
    ),
    gpu_resource: str = typer.Option(
        "ngpus", "--gpu-resource", help="PBS: the site's GPU resource name in select=."
    ),
    output: str = typer.Option(None, "--output", "-o", help="Output file of the job."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the job script; submit nothing."),
) -> int:
    """Submit a Slurm or PBS job that runs `herd launch SCRIPT [ARGS]` on --nodes nodes.

    The script asks for one task per node, warns herd before the time limit (Slurm:
    --signal=B:USR1; PBS: herd computes the deadline from the walltime) and lets herd requeue
    the job after the workers saved a snapshot, so the next allocation resumes from it. Prints
    the job id and how to follow it; `herd ps` lists submitted jobs with their state.
    """
    if scheduler not in ("slurm", "pbs"):
        raise UsageError(f"unknown scheduler {scheduler!r}", "use --scheduler slurm or pbs")
    if script is None:
        raise UsageError("nothing to run", "herd submit --scheduler slurm -N 2 train.py [ARGS]")
    kind: Scheduler = "slurm" if scheduler == "slurm" else "pbs"
    path = None if dry_run else script_path(kind, name)
    spec = SubmitSpec(
        scheduler=kind,
        nodes=nodes,
        launch_args=(script, *ctx.args),
        herd=(sys.executable, "-m", "torchherd"),
        workdir=os.getcwd(),
        time=time_limit,
        gpus_per_node=gpus_per_node,
        cpus_per_node=cpus_per_node,
        partition=partition,
        account=account,
        name=name,
        grace=grace,
        max_requeues=max_requeues,
        gpu_resource=gpu_resource,
        output=output,
        script_path=str(path) if path else None,
    )
    text = render(spec)
    if dry_run or path is None:
        sys.stdout.write(text)
        return EXIT_OK
    path.write_text(text)
    job = submit(kind, path, name, spec.workdir)
    shown_output = output or (f"herd-{job.text}.out" if kind == "slurm" else "")
    print(f"submitted {kind} job {job.text} ({nodes} node(s)); script: {path}")
    print(follow_hint(kind, job.text, shown_output))
    return EXIT_OK
