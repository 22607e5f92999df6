"""`herd bench all`: net, allreduce and scaling in one run, written as one self-contained HTML
page (plots embedded as base64 PNG) plus the JSON, under ~/.herd/bench/<id>/ ($HERD_HOME moves it).

The page opens with the verdict (bench.verdict), then the machines and versions it ran on and
the command line, then each part. A part that cannot run on this cluster (the network test on
one machine) is skipped with the reason; the others still run and the report is written.
The all-reduce plot's reference line is the slowest link `bench net` measured in the same run.
"""

from __future__ import annotations

import asyncio
import base64
import html
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..plan import new_job_id
from ..records import herd_home
from ..spec import ClusterSpec
from .allreduce import AllreduceOptions, AllreduceResult, bench_allreduce
from .net import NetBenchOptions, NetMatrix, bench_net
from .plots import PlotsUnavailable, allreduce_plot, net_heatmap, scaling_plot, size_label
from .scaling import ScalingOptions, ScalingResult, bench_scaling
from .verdict import Finding, judge, overall

Say = Callable[[str], None]


def bench_dir(run_id: str) -> Path:
    return herd_home() / "bench" / run_id


@dataclass
class BenchReport:
    """What one `herd bench all` found; each part is None when it was not run."""

    run_id: str
    hosts: tuple[str, ...]
    started: float
    net: NetMatrix | None = None
    allreduce: AllreduceResult | None = None
    scaling: ScalingResult | None = None
    seconds: float = 0.0
    plots: dict[str, bytes] = field(default_factory=dict)
    plots_missing: str = ""
    """Why there are no plots (the extra to install), empty when there are."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Parts that could not run here (net, allreduce, scaling) -> why."""
    machines: list[dict[str, Any]] = field(default_factory=list)
    """Per node: cores, GPUs, python, torch and torchherd versions (from the quick probe)."""
    command: str = ""
    """The command line that made this report."""

    def findings(self) -> list[Finding]:
        return judge(self.net, self.allreduce, self.scaling, self.skipped)

    def to_dict(self) -> dict[str, Any]:
        status, headline = overall(self.findings())
        return {
            "id": self.run_id,
            "version": __version__,
            "command": self.command,
            "hosts": list(self.hosts),
            "machines": self.machines,
            "started": self.started,
            "seconds": self.seconds,
            "verdict": {
                "status": status,
                "headline": headline,
                "parts": [vars(f) for f in self.findings()],
            },
            "skipped": self.skipped,
            "net": self.net.to_dict() if self.net else None,
            "allreduce": self.allreduce.to_dict() if self.allreduce else None,
            "scaling": self.scaling.to_dict() if self.scaling else None,
        }

    def draw(self) -> None:
        """Draw every plot this run has data for (kept as PNG bytes)."""
        try:
            if self.net is not None:
                self.plots["net"] = net_heatmap(self.net)
            if self.allreduce is not None:
                reference = self.net.reference_gbits() if self.net else None
                self.plots["allreduce"] = allreduce_plot(self.allreduce, reference)
            if self.scaling is not None:
                self.plots["scaling"] = scaling_plot(self.scaling)
        except PlotsUnavailable as exc:
            self.plots.clear()
            self.plots_missing = f"{exc.message}; {exc.remedy}"


def run_all(
    cluster: ClusterSpec,
    net: NetBenchOptions | None = None,
    allreduce: AllreduceOptions | None = None,
    scaling: ScalingOptions | None = None,
    say: Say | None = None,
    command: str = "",
) -> BenchReport:
    """net, then allreduce, then scaling; each stage's errors propagate (HerdError). The
    network test needs two nodes over ssh: elsewhere it is skipped, and the rest runs."""
    say = say or (lambda _: None)
    report = BenchReport(new_job_id(), tuple(n.host for n in cluster.nodes), time.time())
    report.command = command
    started = time.monotonic()
    say("0/3 machines: cores, GPUs and versions")
    report.machines = machines(cluster)
    if cluster.transport == "ssh" and len(cluster.nodes) >= 2:
        say("1/3 network: every pair of nodes")
        report.net = bench_net(cluster, net, say=lambda text: say(f"1/3 network: {text}"))
    else:
        report.skipped["net"] = "it needs at least 2 nodes reached over ssh"
        say(f"1/3 network: skipped ({report.skipped['net']})")
    say("2/3 all-reduce: message sizes through a herd job")
    report.allreduce = bench_allreduce(cluster, allreduce)
    say("3/3 scaling: 1, 2, 4, ... nodes")
    report.scaling = bench_scaling(cluster, scaling, say=lambda text: say(f"3/3 {text}"))
    report.seconds = time.monotonic() - started
    say("drawing the plots")
    report.draw()
    return report


def machines(cluster: ClusterSpec) -> list[dict[str, Any]]:
    """What each node is, from the quick probe launches use (stdlib only, no torch import)."""
    from ..launcher.launch import connect_all, probe_all
    from ..transport import for_cluster

    async def probe() -> list[dict[str, Any]]:
        transport = for_cluster(cluster)
        try:
            await connect_all(cluster, transport)
            facts = await probe_all(cluster, transport)
        finally:
            await transport.close()
        return [
            {
                "host": node.host,
                "cpus": facts[node.host].cpu_count,
                "gpus": facts[node.host].gpu_count,
                "python": facts[node.host].python_version,
                "torch": facts[node.host].torch_version,
                "torchherd": facts[node.host].torchherd_version,
            }
            for node in cluster.nodes
        ]

    return asyncio.run(probe())


def write_report(report: BenchReport, directory: Path | None = None) -> Path:
    """Write report.html, bench.json and the PNGs into ``directory`` (default: the run's
    directory under ~/.herd/bench/); return the HTML's path."""
    directory = directory or bench_dir(report.run_id)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "bench.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    for name, png in report.plots.items():
        (directory / f"{name}.png").write_bytes(png)
    page = directory / "report.html"
    page.write_text(render_html(report))
    return page


def _img(report: BenchReport, name: str, alt: str) -> str:
    png = report.plots.get(name)
    if png is None:
        why = report.plots_missing or "no plot"
        return f"<p class=note>{html.escape(why)}</p>"
    data = base64.b64encode(png).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _rows(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STATUS = {
    "ok": ("✓", "#2a7"),
    "warn": ("!", "#c80"),
    "bad": ("✗", "#c33"),
    "skipped": ("·", "#888"),
}


def _verdict_html(report: BenchReport) -> list[str]:
    """The summary a reader looks for first: the overall verdict, then one line per part."""
    findings = report.findings()
    status, headline = overall(findings)
    mark, color = _STATUS[status]
    items = "".join(
        f'<li><b style="color:{_STATUS[f.status][1]}">{_STATUS[f.status][0]}</b> '
        f"<b>{html.escape(f.part)}</b>: {html.escape(f.text)}</li>"
        for f in findings
    )
    return [
        f'<div class="verdict" style="border-left:.4em solid {color}">'
        f'<p><b style="color:{color}">{mark} Verdict: {html.escape(headline)}</b></p>'
        f"<ul>{items}</ul></div>"
    ]


def render_html(report: BenchReport) -> str:
    """One page, no external resources: tables of the numbers and the embedded plots."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>herd bench {html.escape(report.run_id)}</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:1em 0}td,th{padding:.2em .7em;text-align:right;"
        "border-bottom:1px solid #ddd}td:first-child,th:first-child{text-align:left}"
        "img{max-width:100%}.note{color:#a60}.verdict{background:#f6f6f6;padding:.3em 1em}"
        "</style></head><body>",
        f"<h1>herd bench {html.escape(report.run_id)}</h1>",
        *_verdict_html(report),
        f"<p>{len(report.hosts)} node(s): {html.escape(', '.join(report.hosts))}; "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(report.started))}; "
        f"{report.seconds:.0f} s. Launcher: torchherd {html.escape(__version__)}, Python "
        f"{html.escape(platform.python_version())} on {html.escape(platform.node())}.</p>",
        f"<p>Command: <code>{html.escape(report.command or 'herd bench all')}</code></p>",
    ]
    if report.machines:
        parts.append("<h2>Machines</h2>")
        rows = [
            [
                str(m.get("host", "")),
                str(m.get("cpus", "-")),
                str(m.get("gpus", "-")),
                str(m.get("python") or "-"),
                str(m.get("torch") or "-"),
                str(m.get("torchherd") or "-"),
            ]
            for m in report.machines
        ]
        parts.append(_rows(["node", "CPU cores", "GPUs", "python", "torch", "torchherd"], rows))
    if report.net is not None:
        net = report.net
        parts.append("<h2>Network: TCP between every pair</h2>")
        parts.append(_img(report, "net", "throughput matrix"))
        rows = [
            [
                x.describe(),
                f"{x.gbits:.2f}" if x.gbits is not None else "-",
                f"{x.rtt_ms:.3f}" if x.rtt_ms is not None else "-",
            ]
            for x in sorted(net.links, key=lambda x: (x.src, x.dst))
        ]
        parts.append(_rows(["link", "throughput (Gbit/s)", "round trip (ms)"], rows))
        slow = net.slow_node()
        slowest = net.slowest(1)
        if slowest:
            text = f"Slowest link: {slowest[0].describe()} at {slowest[0].gbits:.2f} Gbit/s."
            if slow:
                text += f" The slow links all touch {slow}."
            parts.append(f"<p>{html.escape(text)}</p>")
    if report.allreduce is not None:
        ar = report.allreduce
        parts.append(f"<h2>All-reduce: {ar.world_size} ranks ({html.escape(ar.backend)})</h2>")
        parts.append(_img(report, "allreduce", "bus bandwidth vs message size"))
        rows = [
            [
                size_label(r.size_bytes),
                f"{r.seconds * 1e6:,.0f}",
                f"{r.algbw_gbytes:.3f}",
                f"{r.busbw_gbytes:.3f}",
                "yes" if r.correct else "NO",
            ]
            for r in ar.rows
        ]
        parts.append(_rows(["size", "time (µs)", "algbw (GB/s)", "busbw (GB/s)", "correct"], rows))
        parts.append(
            "<p>busbw = algbw &times; 2(n-1)/n (nccl-tests): comparable with the link speed "
            "whatever the number of ranks.</p>"
        )
    if report.scaling is not None:
        sc = report.scaling
        parts.append(f"<h2>Scaling: {html.escape(sc.workload)}</h2>")
        parts.append(_img(report, "scaling", "throughput and efficiency vs nodes"))
        rows = [
            [
                str(p.nodes),
                f"{p.seconds:.2f}",
                f"{p.throughput:,.1f}",
                f"{p.efficiency:.0%}",
                f"{p.comm_share:.0%}" if p.comm_share is not None else "-",
            ]
            for p in sc.points
        ]
        parts.append(_rows(["nodes", "seconds", sc.unit, "efficiency", "comm wait"], rows))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
