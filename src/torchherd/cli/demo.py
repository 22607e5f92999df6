"""`herd demo`: the embedded default. A real launch on this machine, no cluster, no GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import typer

from .app import app
from .parsing import HerdCommand


@app.command("demo", cls=HerdCommand)
def demo(
    nproc: int = typer.Option(2, "--nproc", min=1, max=16, help="CPU workers to start."),
) -> int:
    """Train a small model with NPROC CPU workers on this machine, through `herd launch`.

    The same path a cluster launch takes (agent, torchrun, c10d, Gloo, merged logs), on one
    machine, in well under a minute.
    """
    from ..launcher.launch import LaunchOptions, launch
    from ..plan import JobSpec, new_job_id
    from ..records import herd_home
    from ..results import RunResult
    from ..spec import local_cluster

    # The script's path, found without importing it: it imports torch, which the launcher
    # never does (seconds of start, and torch's own teardown at exit).
    demo_spec = importlib.util.find_spec("torchherd.demo.train")
    assert demo_spec is not None and demo_spec.origin is not None

    with tempfile.TemporaryDirectory(prefix="herd-demo-") as scratch:
        summary_file = Path(scratch) / "summary.json"
        cluster = local_cluster(nproc).model_copy(
            update={"env": {"HERD_DEMO_SUMMARY": str(summary_file)}, "source": "herd demo"}
        )
        # Its metrics outlive the scratch folder: `herd report` draws them from the --run-dir
        # among the job's arguments.
        job_id = new_job_id()
        run_dir = herd_home() / "demo" / job_id
        script = os.path.abspath(demo_spec.origin)
        job = JobSpec(entry=(script, "--run-dir", str(run_dir)), nproc=nproc, job_id=job_id)
        print(f"herd demo: training a small model with {nproc} CPU workers on this machine")
        result = launch(cluster, job, LaunchOptions())
        assert isinstance(result, RunResult)
        if result.exit_code == 0 and summary_file.exists():
            summary = json.loads(summary_file.read_text())
            print(
                "\nWhat happened: herd started torchrun through its node agent; "
                f"{summary['world_size']} workers joined a c10d rendezvous, trained "
                f"{summary['steps']} steps of data-parallel SGD on Gloo "
                f"({summary['samples']:,} samples, gradients all-reduced every step) and the loss "
                f"went from {summary['first_loss']:.3f} to {summary['last_loss']:.4f} in "
                f"{summary['seconds']:.1f} s."
            )
            print(
                f"Its story as a page: `herd report {job.job_id}`. Next: describe your machines "
                "with `herd init gpu1 gpu2`, check them with `herd doctor`, then "
                "`herd launch train.py`."
            )
        sys.stdout.flush()
        return result.exit_code
