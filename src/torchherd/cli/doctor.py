"""`herd doctor`: examine every node and say what would make a launch fail, and what to do."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer
from rich.console import Console

if TYPE_CHECKING:
    from ..preflight.doctor import Say

from .app import CLUSTER_HELP, HOSTS_HELP, NODES_HELP, app
from .common import cluster_for
from .parsing import HerdCommand


@app.command("doctor", cls=HerdCommand)
def doctor_command(
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nodes: str = typer.Option(None, "--nodes", help=NODES_HELP),
    nproc: int = typer.Option(
        None, "--nproc", min=1, help="Workers per node to check for (as in launch)."
    ),
    full: bool = typer.Option(
        False, "--full", help="Test every pair of nodes, not only from the rendezvous node."
    ),
    collective: bool = typer.Option(
        False, "--collective", help="Also run a real all-reduce across all nodes."
    ),
    min_gbits: float = typer.Option(
        10.0, "--min-gbits", min=0, help="Warn on links slower than this (Gbit/s)."
    ),
    min_disk_gb: float = typer.Option(
        10.0, "--min-disk-gb", min=0, help="Warn below this much free disk (GB)."
    ),
    fresh: bool = typer.Option(
        False, "--fresh", help="Re-import torch on every node (ignore the remembered result)."
    ),
    paths: list[str] = typer.Option(
        None,
        "--path",
        metavar="DIR",
        help="Check DIR on every node (repeatable): it exists, is writable, its free space, and "
        "whether it is the same storage everywhere (a file written on one node is looked for on "
        "the others). Point it at the job's run or snapshot directory: a node-local one warns, "
        "since a restart that moves ranks to another node would resume from nothing. ~ expands "
        "on each node; a relative DIR is taken from the job's working directory; s3:// and other "
        "URLs are not paths and are left to the job. Without --path no directory is checked.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    verbose: bool = typer.Option(
        False, "-v", "--verbose", help="Show every check's finding, not only problems."
    ),
) -> int:
    """Check every node: ssh, python/torch, versions, GPUs, ports, NICs, names, disk, bandwidth
    (and shared storage, with --path).

    Prints a table of nodes x checks, then what to do about each problem. Exit 0 when nothing
    failed (warnings allowed), 3 when a check failed, 2 for a bad cluster file.
    """
    from ..bench.collective import run_collective
    from ..preflight import Limits  # here: every other command would pay for the doctor's
    from ..preflight.doctor import DoctorOptions, doctor
    from ..preflight.network import NetOptions
    from ..preflight.render import render

    cluster = cluster_for(config, hosts, nodes=nodes, nproc=nproc)
    options = DoctorOptions(
        nproc=nproc,
        full=full,
        collective=collective,
        fresh=fresh,
        paths=tuple(paths or ()),
        limits=Limits(min_gbits=min_gbits, min_disk_gb=min_disk_gb),
        net=NetOptions(full=full),
    )
    err = Console(stderr=True, highlight=False)
    with _progress(err, len(cluster.nodes)) as say:
        report = doctor(cluster, options, say=say, run_collective=run_collective)
    if as_json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    else:
        out = Console(highlight=False)
        out.print(f"herd doctor: {len(cluster.nodes)} node(s) from {cluster.source}\n")
        render(report, out, verbose=verbose)
    return report.exit_code


@contextmanager
def _progress(console: Console, nodes: int) -> Iterator[Say]:
    """A spinner with the current stage on a terminal; silent otherwise (scripts, CI logs)."""
    if not console.is_terminal:
        yield lambda _: None
        return
    with console.status(f"examining {nodes} node(s)") as status:
        yield lambda text: status.update(f"herd doctor: {text}")
