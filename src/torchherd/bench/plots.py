"""The pictures of `herd bench`: PNG bytes drawn with matplotlib, imported only here and only
when a plot is asked for (the ``torchherd[bench]`` extra). Tables and --json never need it."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from .allreduce import AllreduceResult
    from .net import NetMatrix
    from .scaling import ScalingResult

EXTRA = "pip install 'torchherd[bench]'"


class PlotsUnavailable(ConfigError):
    """matplotlib is not installed: the plots (and the HTML report's pictures) cannot be drawn."""


def require_plots() -> None:
    """Raise PlotsUnavailable now, before any measuring, when a plot was asked for and
    matplotlib is missing: an hour of measuring must not end in that error."""
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable(
            "drawing the plots needs matplotlib, which is not installed",
            f"{EXTRA} (tables and --json work without it)",
        ) from None
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buffer.getvalue()


def size_label(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):g} {unit}"
    return f"{size} B"


def net_heatmap(matrix: NetMatrix) -> bytes:
    """Sender x receiver throughput (Gbit/s), slow links in dark cells, values written in."""
    plt = _pyplot()
    hosts = list(matrix.hosts)
    values = [[float("nan")] * len(hosts) for _ in hosts]
    for i, src in enumerate(hosts):
        for j, dst in enumerate(hosts):
            link = matrix.link(src, dst)
            if link is not None and link.gbits is not None:
                values[i][j] = link.gbits
    size = 1.2 + 0.9 * len(hosts)
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    image = ax.imshow(values, cmap="viridis", vmin=0)
    fig.colorbar(image, ax=ax, label="Gbit/s")
    ax.set_xticks(range(len(hosts)), hosts, rotation=45, ha="right")
    ax.set_yticks(range(len(hosts)), hosts)
    ax.set_xlabel("receiver")
    ax.set_ylabel("sender")
    top = max((v for row in values for v in row if v == v), default=0.0)
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            if value == value:  # not NaN
                colour = "white" if value < top * 0.6 else "black"
                ax.text(j, i, f"{value:.3g}", ha="center", va="center", color=colour, fontsize=8)
    slow = matrix.slow_node()
    title = "TCP throughput between nodes"
    ax.set_title(title + (f"\nslow links share {slow}" if slow else ""))
    return _png(fig)


def allreduce_plot(result: AllreduceResult, reference_gbits: float | None) -> bytes:
    """Bus bandwidth vs message size (log x), with the slowest link's speed as a line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes = [row.size_bytes for row in result.rows]
    ax.plot(sizes, [row.busbw_gbytes for row in result.rows], marker="o", label="busbw")
    ax.plot(sizes, [row.algbw_gbytes for row in result.rows], marker=".", ls=":", label="algbw")
    if reference_gbits:
        ax.axhline(
            reference_gbits / 8,
            color="tab:red",
            ls="--",
            label=f"slowest TCP link ({reference_gbits / 8:.3g} GB/s)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [size_label(s) for s in sizes], rotation=45, ha="right")
    ax.set_xlabel("message size")
    ax.set_ylabel("GB/s")
    ax.set_title(
        f"all-reduce on {result.world_size} ranks, {len(result.hosts)} node(s) ({result.backend})"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(fig)


def scaling_plot(result: ScalingResult) -> bytes:
    """Throughput (bars) and per-node efficiency (line) vs the number of nodes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    nodes = [point.nodes for point in result.points]
    labels = [str(n) for n in nodes]
    ax.bar(labels, [p.throughput for p in result.points], color="tab:blue", alpha=0.7)
    ax.set_xlabel("nodes")
    ax.set_ylabel(result.unit)
    right = ax.twinx()
    right.plot(labels, [p.efficiency * 100 for p in result.points], color="tab:orange", marker="o")
    right.set_ylabel("efficiency per node vs 1 node (%)", color="tab:orange")
    right.set_ylim(0, max(110.0, max((p.efficiency * 100 for p in result.points), default=0) + 10))
    ax.set_title(f"scaling: {result.workload}")
    return _png(fig)
