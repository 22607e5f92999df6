"""Tables of `herd bench` results for people (rich); --json prints ``to_dict()`` instead."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .allreduce import AllreduceResult
from .net import NetMatrix
from .plots import size_label
from .scaling import ScalingResult


def _table(*columns: str, left: int = 1) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for index, name in enumerate(columns):
        table.add_column(name, justify="left" if index < left else "right")
    return table


def render_net(matrix: NetMatrix, console: Console) -> None:
    """The throughput matrix (Gbit/s, row sends to column), latency, then the slowest links."""
    hosts = matrix.hosts
    slow = {(x.src, x.dst) for x in matrix.slow_links()}
    for title, pick, fmt in (
        ("throughput, Gbit/s (row sends to column)", "gbits", "{:.2f}"),
        ("latency, median round trip in ms", "rtt_ms", "{:.3f}"),
    ):
        table = _table("", *hosts)
        for src in hosts:
            cells = []
            for dst in hosts:
                link = matrix.link(src, dst)
                value = getattr(link, pick) if link is not None else None
                if src == dst:
                    cells.append("[dim]-[/]")
                elif value is None:
                    error = (link.error or link.throughput_error) if link else "not measured"
                    cells.append(f"[red]✗[/] [dim]{escape(error[:20])}[/]")
                else:
                    text = fmt.format(value)
                    red = pick == "gbits" and (src, dst) in slow
                    cells.append(f"[bold red]{text}[/]" if red else text)
            table.add_row(escape(src), *cells)
        console.print(f"[bold]{title}[/]")
        console.print(table)
        console.print()
    slowest = matrix.slowest()
    if slowest:
        named = ", ".join(f"{escape(x.describe())} {x.gbits:.2f}" for x in slowest)
        console.print(f"slowest links (Gbit/s): {named}")
    node = matrix.slow_node()
    if node:
        console.print(
            f"[bold red]the slow links all touch {escape(node)}[/]: check its NIC, cable, "
            "switch port and MTU"
        )
    elif matrix.slow_links():
        console.print("slow links do not share one node: look at the path between them")
    console.print(
        f"[dim]{len(matrix.measured())} link(s) in {matrix.rounds} round(s) of disjoint "
        f"pairs, {matrix.seconds:.1f} s[/]"
    )


def render_allreduce(
    result: AllreduceResult, console: Console, reference_gbits: float | None = None
) -> None:
    console.print(
        f"[bold]all-reduce[/] on {result.world_size} ranks, {len(result.hosts)} node(s) "
        f"({result.backend}), float32, in-place"
    )
    table = _table("size", "time", "algbw", "busbw", "correct")
    for row in result.rows:
        table.add_row(
            size_label(row.size_bytes),
            f"{row.seconds * 1e6:,.0f} us",
            f"{row.algbw_gbytes:.3f} GB/s",
            f"{row.busbw_gbytes:.3f} GB/s",
            "[green]yes[/]" if row.correct else "[bold red]NO[/]",
        )
    console.print(table)
    peak = result.peak()
    if peak is not None:
        line = f"peak bus bandwidth {peak.busbw_gbytes:.3f} GB/s at {size_label(peak.size_bytes)}"
        if reference_gbits:
            share = peak.busbw_gbytes * 8 / reference_gbits
            line += (
                f", {share:.0%} of the slowest TCP link "
                f"({reference_gbits:.2f} Gbit/s = {reference_gbits / 8:.3f} GB/s)"
            )
        console.print(line)
    if not result.correct:
        console.print("[bold red]the all-reduce returned wrong sums[/]")


def render_scaling(result: ScalingResult, console: Console) -> None:
    console.print(f"[bold]scaling[/]: {escape(result.workload)}")
    table = _table("nodes", "ranks", "time", result.unit, "efficiency", "comm wait")
    for p in result.points:
        table.add_row(
            str(p.nodes),
            str(p.world_size) if p.world_size is not None else "-",
            f"{p.seconds:.2f} s",
            f"{p.throughput:,.1f}",
            f"{p.efficiency:.0%}",
            f"{p.comm_share:.0%}" if p.comm_share is not None else "-",
        )
    console.print(table)
    console.print(
        "[dim]efficiency: throughput / (nodes x 1-node throughput); comm wait: share of "
        "step time not explained by compute alone[/]"
    )
