"""`herd bench net|allreduce|scaling|all`: measure what the cluster delivers (tables, --json,
PNG plots with the ``torchherd[bench]`` extra, one HTML report for `all`)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from ..errors import EXIT_JOB_FAILED, UsageError
from .app import CLUSTER_HELP, app
from .common import cluster_for

bench_app = typer.Typer(
    help="Measure the cluster: TCP between every pair, all-reduce bandwidth, scaling.\n\n"
    "Tables by default, --json for scripts, PNG plots with --png (pip install "
    "'torchherd\\[bench]'); `herd bench all` writes one HTML report under ~/.herd/bench/.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")

HOSTS_HELP = "Hosts instead of a file: gpu1:4,gpu2:4."
JSON_HELP = "Print the result as JSON on stdout (no table)."
PNG_HELP = "Also write the plot to this PNG file (needs the torchherd\\[bench] extra)."

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str, option: str) -> int:
    """1024, 1K, 64M, 1G, 512KiB, 4MB -> bytes (binary units, as nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgKMG]?)(?:i?[bB])?\s*", text)
    if not match:
        raise UsageError(
            f"{option}: cannot read {text!r} as a size", "write it like 1024, 64K, 32M or 1G"
        )
    return int(match[1]) * _UNITS[match[2].lower()]


@contextmanager
def _progress(console: Console, what: str, *, lines: bool = False) -> Iterator[Any]:
    """A spinner with the current stage on a terminal; elsewhere (scripts, CI logs) one line
    per stage on stderr with ``lines``, else nothing."""
    if not console.is_terminal:
        yield (
            (lambda text: print(f"herd bench: {text}", file=sys.stderr))
            if lines
            else (lambda _: None)
        )
        return
    with console.status(what) as status:
        yield lambda text: status.update(f"herd bench: {text}")


def _plots_possible(png: str | None) -> None:
    """--png without matplotlib is an error before anything is measured."""
    if png:
        from ..bench.plots import require_plots

        require_plots()


def _write_png(path: str | None, draw: Any) -> None:
    if not path:
        return
    png = draw()
    Path(path).write_bytes(png)
    sys.stdout.flush()
    print(f"plot: {path}", file=sys.stderr)


def _show(
    result: Any, as_json: bool, render: Callable[[Console], None], png: str | None, draw: Any
) -> None:
    """--json or the table, then the plot when --png asks for one."""
    if as_json:
        _print_json(result.to_dict())
    else:
        render(Console(highlight=False))
    _write_png(png, draw)


def _print_json(value: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


@bench_app.command("net")
def net_command(
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    seconds: float = typer.Option(
        1.0, "--seconds", min=0.1, help="Longest throughput test per link and direction."
    ),
    pings: int = typer.Option(20, "--pings", min=1, help="Round trips per link for latency."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    png: str = typer.Option(None, "--png", help=PNG_HELP + " A sender x receiver heatmap."),
) -> int:
    """TCP throughput and latency between every pair of nodes, both directions.

    Pairs are measured in rounds where no node appears twice, so links never share a NIC and
    the time grows with the number of nodes, not of pairs. Prints the throughput and latency
    matrices (row sends to column), the slowest links and the node they share.
    """
    from ..bench.net import NetBenchOptions, bench_net
    from ..bench.plots import net_heatmap
    from ..bench.render import render_net

    _plots_possible(png)
    cluster = cluster_for(config, hosts)
    err = Console(stderr=True, highlight=False)
    with _progress(err, f"measuring {len(cluster.nodes)} node(s)") as say:
        matrix = bench_net(cluster, NetBenchOptions(seconds=seconds, pings=pings), say=say)
    _show(matrix, as_json, lambda out: render_net(matrix, out), png, lambda: net_heatmap(matrix))
    return 0


@bench_app.command("allreduce")
def allreduce_command(
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nproc: int = typer.Option(None, "--nproc", min=1, help="Workers per node (as in launch)."),
    min_size: str = typer.Option("1K", "--min-size", help="Smallest message: 1K, 64K, 1M..."),
    max_size: str = typer.Option("64M", "--max-size", help="Largest message: 32M, 1G..."),
    factor: int = typer.Option(4, "--factor", min=2, help="Each size is the last one times F."),
    seconds: float = typer.Option(
        0.5, "--seconds", min=0.01, help="Rough time budget per size (3 to 200 rounds)."
    ),
    iters: int = typer.Option(0, "--iters", min=0, help="Timed rounds per size (0: budget)."),
    link_gbits: float = typer.Option(
        None,
        "--link-gbits",
        min=0,
        help="Link speed (Gbit/s, e.g. from `herd bench net`) drawn as the reference line.",
    ),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    png: str = typer.Option(None, "--png", help=PNG_HELP + " busbw vs message size."),
) -> int:
    """All-reduce time, algbw and busbw per message size, like nccl-tests' all_reduce_perf.

    Runs as a herd job (plan, node agents, torchrun; NCCL on GPUs, Gloo on CPUs), so it
    measures what a training job gets. busbw = algbw x 2(n-1)/n compares with link speed.
    Every size is checked for the exact sum on every rank; exit 1 when one is wrong.
    """
    from ..bench.allreduce import AllreduceOptions, bench_allreduce
    from ..bench.plots import allreduce_plot
    from ..bench.render import render_allreduce

    options = AllreduceOptions(
        min_size=parse_size(min_size, "--min-size"),
        max_size=parse_size(max_size, "--max-size"),
        factor=factor,
        seconds=seconds,
        iters=iters,
        nproc=nproc,
    )
    options.sizes()  # a bad range is a usage error before anything starts
    _plots_possible(png)
    cluster = cluster_for(config, hosts, nproc=nproc)
    err = Console(stderr=True, highlight=False)
    with _progress(err, f"all-reduce on {len(cluster.nodes)} node(s)"):
        result = bench_allreduce(cluster, options)
    _show(
        result,
        as_json,
        lambda out: render_allreduce(result, out, link_gbits),
        png,
        lambda: allreduce_plot(result, link_gbits),
    )
    return 0 if result.correct else EXIT_JOB_FAILED


@bench_app.command(
    "scaling", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def scaling_command(
    ctx: typer.Context,
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nproc: int = typer.Option(None, "--nproc", min=1, help="Workers per node (as in launch)."),
    steps: int = typer.Option(20, "--steps", min=1, help="Timed steps per rank."),
    batch: int = typer.Option(64, "--batch", min=1, help="Samples per rank per step."),
    width: int = typer.Option(1024, "--width", min=1, help="Hidden width of the reference MLP."),
    max_nodes: int = typer.Option(None, "--max-nodes", min=1, help="Stop at this many nodes."),
    script: str = typer.Option(
        None,
        "--script",
        help="Your training script instead of the reference model (its args after --).",
    ),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    png: str = typer.Option(None, "--png", help=PNG_HELP + " Throughput and efficiency vs nodes."),
) -> int:
    """The same work on 1, 2, 4, ... N nodes: throughput, efficiency, communication wait.

    Weak scaling: every rank does the same steps, so N nodes should deliver N times one node.
    Efficiency = throughput / (nodes x 1-node throughput). For the reference model, "comm
    wait" is the share of step time spent waiting on the gradient all-reduce (steps with and
    without DDP's sync). With --script, each run's wall time (start-up included) is the measure.
    """
    from ..bench.plots import scaling_plot
    from ..bench.render import render_scaling
    from ..bench.scaling import ScalingOptions, bench_scaling

    if ctx.args and not script:
        raise UsageError(
            f"unexpected arguments: {' '.join(ctx.args)}",
            "arguments after the options go to --script SCRIPT; see `herd bench scaling -h`",
        )
    _plots_possible(png)
    cluster = cluster_for(config, hosts, nproc=nproc)
    options = ScalingOptions(
        steps=steps,
        batch=batch,
        width=width,
        script=script,
        script_args=tuple(a for a in ctx.args if a != "--"),
        nproc=nproc,
        max_nodes=max_nodes,
    )
    err = Console(stderr=True, highlight=False)
    with _progress(err, "scaling") as say:
        result = bench_scaling(cluster, options, say=say)
    _show(
        result, as_json, lambda out: render_scaling(result, out), png, lambda: scaling_plot(result)
    )
    return 0


@bench_app.command("all")
def all_command(
    config: str = typer.Option(None, "-c", "--config", help=CLUSTER_HELP),
    hosts: str = typer.Option(None, "-H", "--hosts", help=HOSTS_HELP),
    nproc: int = typer.Option(None, "--nproc", min=1, help="Workers per node (as in launch)."),
    max_size: str = typer.Option("64M", "--max-size", help="Largest all-reduce message."),
    steps: int = typer.Option(20, "--steps", min=1, help="Timed scaling steps per rank."),
    output: str = typer.Option(
        None, "-o", "--output", help="Directory for the report (default: ~/.herd/bench/<id>/)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the whole result as JSON too."),
) -> int:
    """Run net, allreduce and scaling; write report.html (plots embedded) and bench.json.

    The report goes to ~/.herd/bench/<id>/ ($HERD_HOME moves it) or --output; the path is
    printed at the end. The all-reduce plot's reference line is the slowest link measured.
    """
    from ..bench.allreduce import AllreduceOptions
    from ..bench.render import render_allreduce, render_net, render_scaling
    from ..bench.report import run_all, write_report
    from ..bench.scaling import ScalingOptions

    allreduce = AllreduceOptions(max_size=parse_size(max_size, "--max-size"), nproc=nproc)
    allreduce.sizes()
    cluster = cluster_for(config, hosts, nproc=nproc)
    err = Console(stderr=True, highlight=False)
    with _progress(err, f"herd bench on {len(cluster.nodes)} node(s)", lines=True) as say:
        report = run_all(
            cluster,
            allreduce=allreduce,
            scaling=ScalingOptions(steps=steps, nproc=nproc),
            say=say,
        )
    page = write_report(report, Path(output) if output else None)
    if as_json:
        _print_json({**report.to_dict(), "report": str(page)})
    else:
        out = Console(highlight=False)
        assert report.net and report.allreduce and report.scaling
        render_net(report.net, out)
        out.print()
        render_allreduce(report.allreduce, out, report.net.reference_gbits())
        out.print()
        render_scaling(report.scaling, out)
        out.print()
    if report.plots_missing:
        print(f"herd bench: no plots: {report.plots_missing}", file=sys.stderr)
    print(f"report: {page}", file=sys.stderr if as_json else sys.stdout)
    return 0 if report.allreduce is None or report.allreduce.correct else EXIT_JOB_FAILED
