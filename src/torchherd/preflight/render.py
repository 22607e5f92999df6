"""The doctor's report for people: a table of nodes x checks, the differences, then remedies.

Problems that share a check and a remedy are listed once with every node they hit, so eight
nodes with the same /etc/hosts line make one remedy, not eight.
"""

from __future__ import annotations

import textwrap

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import CHECKS
from .report import CheckResult, PreflightReport, Status

SYMBOLS = {
    Status.PASS: ("✓", "green"),
    Status.WARN: ("!", "yellow"),
    Status.FAIL: ("✗", "bold red"),
    Status.SKIP: ("·", "dim"),
}


def _symbol(status: Status) -> str:
    text, style = SYMBOLS[status]
    return f"[{style}]{text}[/]"


def _size(value: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift:
            return f"{value / (1 << shift):g} {unit}"
    return f"{value} B"


def render(report: PreflightReport, console: Console, *, verbose: bool = False) -> None:
    console.print(_table(report, console.width))
    console.print("[dim]✓ pass  ! warning  ✗ failed  · not run or not applicable[/]")
    if report.versions:
        console.print()
        console.print(_versions(report))
    _network(report, console)
    _collective(report, console)
    if verbose:
        _details(report, console)
    _problems(report, console)
    failed = [r for r in report.results if r.status is Status.FAIL]
    warned = [r for r in report.results if r.status is Status.WARN]
    nodes = len({r.host for r in failed if r.host})
    console.print()
    if failed:
        console.print(
            f"[bold red]{len(failed)} check(s) failed[/] on {nodes} node(s), "
            f"{len(warned)} warning(s), in {report.seconds:.1f} s. Exit 3."
        )
    else:
        console.print(
            f"[green]All {len(report.hosts)} node(s) ready[/]"
            f"{f' ({len(warned)} warning(s))' if warned else ''}, "
            f"in {report.seconds:.1f} s."
        )


def _table(report: PreflightReport, width: int = 200) -> Table:
    """Nodes x checks. At ``width`` columns the checks' headers are never cut: the node column
    gives way (a long name ends in "…"; the findings below name nodes in full)."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=0)
    ran = {r.check for r in report.results}
    columns = [c for c in CHECKS if not c.optional or c.id in ran]
    room = width - sum(len(c.header) for c in columns) - len(columns)
    table.add_column("node", no_wrap=True, overflow="ellipsis", max_width=max(6, room))
    for check in columns:
        table.add_column(check.header, justify="center", no_wrap=True, min_width=len(check.header))
    for host in report.hosts:
        # A check may have several results on a node (storage: one per --path): the worst shows.
        cells = [_symbol(_worst(report, check.id, host)) for check in columns]
        table.add_row(escape(host), *cells)
    return table


_SEVERITY = (Status.FAIL, Status.WARN, Status.PASS, Status.SKIP)


def _worst(report: PreflightReport, check: str, host: str) -> Status:
    found = {r.status for r in report.results if r.check == check and r.host == host}
    return next((status for status in _SEVERITY if status in found), Status.SKIP)


def _versions(report: PreflightReport) -> Table:
    table = Table(
        title="versions that differ",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    table.add_column("")
    for host in report.hosts:
        table.add_column(escape(host))
    for name, values in report.versions.items():
        table.add_row(name, *(escape(str(values.get(h) or "-")) for h in report.hosts))
    return table


def _network(report: PreflightReport, console: Console) -> None:
    measured = [link for link in report.links if link.gbits is not None]
    slowest = report.slowest_link()
    if slowest is None:
        return
    rtts = [link.rtt_ms for link in report.links if link.rtt_ms is not None]
    latency = f"; latency {min(rtts):.2f}-{max(rtts):.2f} ms" if rtts else ""
    node = report.slow_node()
    shared = f"; the slow links all touch [bold]{escape(node)}[/]" if node else ""
    console.print(
        f"\nnetwork: {len(measured)} link(s) measured, slowest "
        f"{escape(slowest.describe())} at {slowest.gbits:.1f} Gbit/s{latency}{shared}"
    )


def _collective(report: PreflightReport, console: Console) -> None:
    result = report.result("collective", None)
    if result is None:
        return
    console.print(f"\n{_symbol(result.status)} {escape(result.summary)}")
    if not report.collective:
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name in ("size", "time", "algbw", "busbw"):
        table.add_column(name, justify="right")
    for row in report.collective:
        table.add_row(
            _size(row.size_bytes),
            f"{row.seconds * 1e6:,.0f} us",
            f"{row.algbw_gbytes:.3f} GB/s",
            f"{row.busbw_gbytes:.3f} GB/s",
        )
    console.print(table)


def _details(report: PreflightReport, console: Console) -> None:
    for host in report.hosts:
        console.print(f"\n[bold]{escape(host)}[/]")
        for result in report.results:
            if result.host == host:
                console.print(
                    f"  {_symbol(result.status)} {result.check:<11} {escape(result.summary)}"
                )


def _problems(report: PreflightReport, console: Console) -> None:
    groups: dict[tuple[str, Status, str], list[CheckResult]] = {}
    for result in report.problems():
        groups.setdefault((result.check, result.status, result.remedy), []).append(result)
    if not groups:
        return
    console.print("\n[bold]What to do[/]")
    for number, ((check, status, remedy), results) in enumerate(groups.items(), start=1):
        first = results[0]
        head = f"{number:>2}. {SYMBOLS[status][0]} "
        _hanging(
            console,
            f"{number:>2}. {_symbol(status)} ",
            len(head),
            f"{first.host or 'cluster'} {check}: {first.summary}",
        )
        others = [r.host for r in results[1:] if r.host]
        if others:
            _hanging(console, " " * len(head), len(head), f"also on {', '.join(others)}", "dim")
        if remedy:
            _hanging(console, " " * len(head), len(head), f"fix: {remedy}")


def _hanging(console: Console, head: str, width: int, text: str, style: str = "") -> None:
    """``head`` then ``text`` wrapped to the console, continuation lines under the text."""
    lines = textwrap.wrap(text, max(40, console.width - width)) or [""]
    body = "\n".join((" " * width if i else "") + line for i, line in enumerate(lines))
    console.print(
        head + (f"[{style}]{escape(body)}[/]" if style else escape(body)),
        soft_wrap=True,
        highlight=False,
    )
