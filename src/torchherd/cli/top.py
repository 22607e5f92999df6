"""`herd top`: a live table of every node: CPU, memory, GPUs, and the running job's step rate
and recent step times (a sparkline per node on one scale, so a slow node's is the tall one)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import TYPE_CHECKING

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from ..ops.top import NodeLoad

from ..errors import EXIT_NODE_NOT_READY, EXIT_OK
from .app import CLUSTER_HELP, HOSTS_HELP, NODES_HELP, app
from .common import cluster_for
from .parsing import HerdCommand
from .tables import result_table


def _gib(count: int | None) -> str:
    return "-" if count is None else f"{count / 2**30:.1f}"


# Below this many columns the table is compact: short GPU names and job ids (the id's last
# part, which `herd logs` and `herd stop` accept), no temperature and power columns, so an
# 80-column terminal shows one line per node.
COMPACT_BELOW = 120


def _job_text(load: NodeLoad, compact: bool = False) -> tuple[str, str]:
    if not load.jobs:
        return "-", "-"
    job = load.jobs[0]
    more = f" +{len(load.jobs) - 1}" if len(load.jobs) > 1 else ""
    job_id = str(job["job_id"])
    if compact:
        job_id = job_id.rsplit("-", 1)[-1]
    step, rate, age = job.get("step"), job.get("step_rate"), job.get("step_age")
    if step is None:
        return job_id + more, "-"
    text = f"step {step}"
    if age is not None and age > 60:
        text += f", stalled {age:.0f}s"
    elif rate is not None:
        text += f", {rate:.2f}/s"
    return job_id + more, text


# Eighths of a character cell, low to high: one per recent step time.
BLOCKS = "▁▂▃▄▅▆▇█"
# Step times a compact table's sparkline shows (the newest).
COMPACT_SPARK = 8


def _step_times(load: NodeLoad) -> list[float]:
    """The running job's recent step times on the node (agent/recent_steps.py), if any."""
    values = load.jobs[0].get("step_times") if load.jobs else None
    return [float(v) for v in values if isinstance(v, int | float)] if values else []


def sparkline(values: list[float], lo: float, hi: float) -> str:
    """One block per value, its height on the scale ``lo`` to ``hi`` (shared by every node,
    so nodes compare at a glance); all alike: the middle block."""
    if hi - lo <= 0.02 * hi:  # within 2 %: steady, not a shape to read
        return BLOCKS[3] * len(values)
    top = len(BLOCKS) - 1
    return "".join(BLOCKS[round((min(max(v, lo), hi) - lo) / (hi - lo) * top)] for v in values)


def _step_time_cells(loads: list[NodeLoad], compact: bool) -> dict[str, str]:
    """host -> its STEP TIME cell: the recent step times' sparkline, and the newest in ms."""
    recent = {load.host: _step_times(load) for load in loads}
    if compact:
        recent = {host: values[-COMPACT_SPARK:] for host, values in recent.items()}
    every = [v for values in recent.values() for v in values]
    if not every:
        return {}
    lo, hi = min(every), max(every)
    cells = {}
    for host, values in recent.items():
        if values:
            line = sparkline(values, lo, hi)
            cells[host] = line if compact else f"{line} {values[-1] * 1000:.0f}ms"
    return cells


def render_view(loads: list[NodeLoad], width: int | None = None) -> Group:
    """The table, and under it each running replica-group job's groups and the slow ranks
    herd named in running jobs."""
    from ..ops.top import replica_groups, slow_ranks

    groups = [Text(line) for line in replica_groups(loads)]
    notes = [Text(line, style="yellow") for line in slow_ranks()]
    return Group(render(loads, width), *groups, *notes)


def _gpu_name(name: str, compact: bool) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "H100" when compact."""
    if not compact:
        return name
    words = [w for w in name.split() if w not in ("NVIDIA", "GeForce", "Tesla")]
    return words[0] if words else name


def render(loads: list[NodeLoad], width: int | None = None) -> Table:
    """One row per node; GPU columns show the mean/sum/max over the node's GPUs. ``width``:
    the terminal's columns (compact below COMPACT_BELOW); None: as wide as needed."""
    compact = width is not None and width < COMPACT_BELOW
    # Shown only while some node's job times its steps (the Trainer does).
    step_cells = _step_time_cells(loads, compact)
    columns = (
        "HOST",
        "CPU%",
        "MEM GiB",
        "GPUS",
        "GPU%",
        "GPU MEM GiB",
        *(() if compact else ("TEMP C", "POWER W")),
        "JOB",
        "PROGRESS",
        *(("STEP TIME",) if step_cells else ()),
    )
    table = result_table(columns, right=set(columns) - {"HOST", "JOB", "PROGRESS", "STEP TIME"})
    for column in table.columns:  # one line per node: cut what does not fit, never wrap
        column.no_wrap = True
        column.overflow = "ellipsis"
    for load in loads:
        if load.error is not None:
            error = Text(load.error, style="red")
            table.add_row(load.host, error, *([""] * (len(columns) - 2)))
            continue
        cpu = "-" if load.cpu_percent is None else f"{load.cpu_percent:.0f}"
        mem = f"{_gib(load.mem_used)}/{_gib(load.mem_total)}"
        job, progress = _job_text(load, compact)
        if load.gpus:
            gpu = load.gpu_summary()
            names = {_gpu_name(str(g.get("name", "")), compact) for g in load.gpus}
            label = f"{gpu['count']}× {names.pop()}" if len(names) == 1 else f"{gpu['count']}"
            row = [
                label,
                "-" if gpu["util"] is None else f"{gpu['util']:.0f}",
                f"{_gib(gpu['mem_used'])}/{_gib(gpu['mem_total'])}",  # type: ignore[arg-type]
                "-" if gpu["temp"] is None else f"{gpu['temp']:.0f}",
                "-" if gpu["power"] is None else f"{gpu['power']:.0f}",
            ]
        else:
            row = ["none", "-", "-", "-", "-"]
        if compact:
            row = row[:3]
        steps = [step_cells.get(load.host, "-")] if step_cells else []
        table.add_row(load.host, cpu, mem, *row, job, progress, *steps)
    return table


@app.command("top", cls=HerdCommand)
def top_command(
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nodes: str = typer.Option(None, "--nodes", help=NODES_HELP),
    once: bool = typer.Option(False, "--once", help="Print one table and exit."),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="Seconds between refreshes."),
    as_json: bool = typer.Option(False, "--json", help="With --once: the samples as JSON."),
) -> int:
    """Live view per node: CPU, memory, GPU utilisation/memory/temperature/power, job progress.

    GPUs come from NVML or nvidia-smi on each node; nodes without GPUs show CPU and memory.
    Progress is the last `step N` that local rank 0 printed, and its rate. Where the job's
    ranks time their steps (torchherd.train's Trainer), STEP TIME shows the node's recent
    step times (its slowest rank's work per step, its wait for the others left out) as a
    sparkline on one scale for all nodes, and the newest. Under the table, a job run as
    replica groups (launched from this machine) shows each group's node and step, or how
    long it has been down. Ctrl-C ends it.
    """
    from ..ops.top import NodeLoad, follow, sample_once  # here: it reaches for the spec models

    cluster = cluster_for(config, hosts, nodes=nodes)
    if once or as_json:
        loads = sample_once(cluster, window=min(interval, 1.0))
        if as_json:
            print(json.dumps([load.as_json() for load in loads], indent=2))
        else:
            tty = sys.stdout.isatty()
            out = Console(width=None if tty else 200, highlight=False)
            out.print(render_view(loads, out.width))
        return EXIT_NODE_NOT_READY if any(load.error for load in loads) else EXIT_OK
    latest = {n.host: NodeLoad(n.host, error="waiting for the first sample") for n in cluster.nodes}
    screen = Console(highlight=False)

    def table() -> Group:
        return render_view(list(latest.values()), screen.width)

    with Live(table(), console=screen, refresh_per_second=4, screen=False) as live:

        def on_sample(load: NodeLoad) -> None:
            latest[load.host] = load
            live.update(table())

        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(follow(cluster, interval, on_sample))
    return EXIT_OK
