"""The pictures of the report page as inline SVG text: no plotting library, no file beside the
page. A timeline of attempts, a strip per node of its step time on the same time axis, and a
line chart of one metric over steps."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# outcome -> fill colour of its attempt's bar
OUTCOME_COLOURS = {
    "succeeded": "#2a9d5c",
    "failed": "#d1495b",
    "hung": "#e07a1f",
    "lost": "#8e5cc2",
    "stopped": "#8a8a8a",
    "interrupted": "#8a8a8a",
    "saved": "#3b7dd8",
    "finished, a rank never exited": "#6a9d2a",
    "running": "#7fb8e6",
}
FALLBACK_COLOUR = "#b0b0b0"
# Points of a node's step-time strip its latest value is the median of.
LATEST = 5


def svg_text(x: float, y: float, words: str, **attrs: Any) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}"{extra}>{html.escape(words)}</text>'


def duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def svg_open(width: float, height: float, label: str, font_size: int = 12) -> str:
    """The opening tag of one picture: its size, and what a screen reader says it shows."""
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(label)}" '
        f'font-family="sans-serif" font-size="{font_size}">'
    )


@dataclass(frozen=True)
class TimeAxis:
    """The job's time, ``start`` to ``end``, across a picture's plot from ``left`` to
    ``width - right``: the timeline of attempts, the replica groups and the step-time strips
    share it, so one moment sits at one x in each."""

    start: float
    end: float
    width: float
    left: float
    right: float

    @property
    def span(self) -> float:
        return max(self.end - self.start, 1e-3)

    @property
    def plot(self) -> float:
        """The plot's width: the whole job's length."""
        return self.width - self.left - self.right

    def x(self, t: float) -> float:
        """Where moment ``t`` (clamped to the job) sits."""
        return self.left + (min(max(t, self.start), self.end) - self.start) * self.plot / self.span

    def ends(self, y: float) -> list[str]:
        """The axis' two labels at height ``y``: 0 s at the left, the job's length at the right."""
        return [
            svg_text(self.left, y, "0 s", fill="#555"),
            svg_text(
                self.width - self.right, y, duration(self.span), fill="#555", text_anchor="end"
            ),
        ]

    def line(self, y: float) -> str:
        return (
            f'<line x1="{self.left}" y1="{y}" x2="{self.width - self.right}" y2="{y}" '
            'stroke="#999"/>'
        )


def timeline(attempts: Sequence[dict[str, Any]], start: float, end: float) -> str:
    """One bar per attempt on a shared time axis (job start to end), coloured by outcome,
    with how the fault was noticed at its end and why the next one started."""
    width, row = 900, 46
    height = 40 + row * max(1, len(attempts))
    axis = TimeAxis(start, end, width, left=110, right=20)
    x = axis.x
    parts = [svg_open(width, height, "timeline of attempts")]
    for i, attempt in enumerate(attempts):
        top = 12 + i * row
        began = _number(attempt.get("started"), start)
        ended = _number(attempt.get("ended"), end)
        outcome = str(attempt.get("outcome") or "unknown")
        colour = OUTCOME_COLOURS.get(outcome, FALLBACK_COLOUR)
        x0, x1 = x(began), max(x(ended), x(began) + 2)
        parts.append(svg_text(8, top + 17, f"attempt {attempt.get('n', i)}", font_weight="bold"))
        parts.append(
            f'<rect x="{x0:.1f}" y="{top}" width="{x1 - x0:.1f}" height="24" rx="3" '
            f'fill="{colour}"><title>{html.escape(_tooltip(attempt))}</title></rect>'
        )
        world = attempt.get("world_size")
        label = f"{outcome}" + (f", world {world}" if world is not None else "")
        parts.append(svg_text(x0 + 4, top + 16, label, fill="#fff"))
        if outcome not in ("succeeded", "running"):
            # the fault: where the attempt ended, and how herd noticed it
            parts.append(
                f'<path d="M{x1:.1f},{top - 3} l-5,-7 h10 z" fill="#222">'
                f"<title>{html.escape(str(attempt.get('noticed') or outcome))}</title></path>"
            )
        if attempt.get("stacks_dir"):
            parts.append(svg_text(x1 + 3, top + 16, "stacks", fill="#555"))
        noticed = attempt.get("noticed")
        if noticed:
            parts.append(svg_text(x0, top + 37, f"noticed: {noticed}", fill="#555", font_size="11"))
    parts += [axis.line(height - 18), *axis.ends(height - 8), "</svg>"]
    return "".join(parts)


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, int | float) else default


def _tooltip(attempt: dict[str, Any]) -> str:
    bits = [f"attempt {attempt.get('n')}: {attempt.get('outcome')}"]
    for key in ("how", "why", "noticed"):
        if attempt.get(key):
            bits.append(f"{key}: {attempt[key]}")
    return "; ".join(bits)


def nice_ticks(lo: float, hi: float, most: int = 6) -> list[float]:
    """Round values (1, 2 or 5 times a power of ten apart) from ``lo`` to ``hi``."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / max(most - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    """1, 2 and 5 times each power of ten between ``lo`` and ``hi`` (both > 0); only the
    powers of ten where that makes too many."""
    ticks = []
    for power in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        for mantissa in (1, 2, 5):
            value = mantissa * 10.0**power
            if lo * (1 - 1e-9) <= value <= hi * (1 + 1e-9):
                ticks.append(value)
    if len(ticks) > 8:
        ticks = [t for t in ticks if math.isclose(t, 10 ** round(math.log10(t)))]
    if len(ticks) < 2:  # a range within one 1-2-5 step: the ends themselves
        ticks = sorted({lo, hi})
    return ticks


def line_chart(
    points: Sequence[tuple[float, float]],
    label: str,
    colour: str = "#3b7dd8",
    *,
    log: bool = False,
    x_label: str = "step",
) -> str:
    """``label`` against ``x_label`` with ticks on both axes; ``log``: a logarithmic y axis
    (a loss falls by decades; on a linear axis its end is a flat line). A log axis needs
    every value above zero: with one at or below zero the axis stays linear and says so."""
    width, height, left, bottom, top, right = 440, 240, 58, 44, 24, 14
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    log = log and min(ys) > 0
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(ys), max(ys)
    if math.isclose(x_lo, x_hi):
        x_hi = x_lo + 1
    if math.isclose(y_lo, y_hi):
        y_hi = y_lo + (abs(y_lo) or 1) * 0.1
    plot_w, plot_h = width - left - right, height - top - bottom

    def fy(y: float) -> float:
        return math.log10(y) if log else y

    def px(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * plot_w

    def py(y: float) -> float:
        return top + (1 - (fy(y) - fy(y_lo)) / (fy(y_hi) - fy(y_lo))) * plot_h

    path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
    title = label + (" (log scale)" if log else "")
    parts = [
        svg_open(width, height, title, font_size=11),
        svg_text(left, 14, title, font_weight="bold", font_size="12"),
        f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" '
        'stroke="#ccc"/>',
    ]
    for value in log_ticks(y_lo, y_hi) if log else nice_ticks(y_lo, y_hi):
        y = py(value)
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#eee"/>'
        )
        parts.append(svg_text(left - 4, y + 4, _short(value), text_anchor="end", fill="#555"))
    for value in nice_ticks(x_lo, x_hi):
        x = px(value)
        parts.append(
            f'<line x1="{x:.1f}" y1="{top + plot_h}" x2="{x:.1f}" y2="{top + plot_h + 4}" '
            'stroke="#999"/>'
        )
        below = top + plot_h + 15
        parts.append(svg_text(x, below, _short(value), text_anchor="middle", fill="#555"))
    parts += [
        svg_text(left + plot_w / 2, height - 6, x_label, text_anchor="middle", fill="#333"),
        f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.6"/>',
        "</svg>",
    ]
    return "".join(parts)


def _short(value: float) -> str:
    if value == int(value) and abs(value) < 1e7:
        return f"{int(value)}"
    return f"{value:.3g}"


def strips(
    series: dict[str, list[tuple[float, float]]],
    start: float,
    end: float,
    marks: dict[str, float] | None = None,
    label: str = "step time",
) -> str:
    """One compact strip per node of (time, seconds) points, on the timeline's time axis
    (job start to end, same margins) and one scale shared by all (``shared_range``), so the
    slow node's strip sits higher than the others'; at its right its latest value (the
    median of its last LATEST points). ``marks``: host -> when herd named it slow (a red
    tick there)."""
    # The timeline's plot (110 to 880 of 900), and room at the right for each latest value.
    width, left, right, row, gap = 960, 110, 80, 26, 6
    hosts = list(series)
    height = 30 + (row + gap) * max(1, len(hosts))
    time_axis = TimeAxis(start, end, width, left, right)
    x = time_axis.x
    lowest, highest = shared_range([v for points in series.values() for _, v in points])
    parts = [svg_open(width, height, f"{label} per node")]
    for i, host in enumerate(hosts):
        top = 8 + i * (row + gap)
        points = sorted(series[host])
        ys = [v for _, v in points]
        parts.append(svg_text(8, top + row / 2 + 4, host, font_weight="bold"))
        parts.append(
            f'<rect x="{left}" y="{top}" width="{time_axis.plot}" height="{row}" fill="#f4f4f4"/>'
        )
        path = " ".join(
            f"{x(t):.1f},{top + row * (1 - _share(v, lowest, highest)):.1f}" for t, v in points
        )
        parts.append(
            f'<polyline points="{path}" fill="none" stroke="#8e5cc2" stroke-width="1.4" '
            f'data-host="{html.escape(host)}"/>'
        )
        latest = sorted(ys[-LATEST:])[len(ys[-LATEST:]) // 2]  # ys: at least one point
        parts.append(svg_text(width - right + 6, top + row / 2 + 4, _seconds(latest), fill="#333"))
        named = (marks or {}).get(host)
        if named is not None:
            mx = x(named)
            parts.append(
                f'<line x1="{mx:.1f}" y1="{top - 3}" x2="{mx:.1f}" y2="{top + row + 3}" '
                f'stroke="#d1495b" stroke-width="2" class="named-slow"><title>'
                f"{html.escape(host)} named slow here</title></line>"
            )
    axis = height - 10
    parts += time_axis.ends(axis)
    parts.append(
        svg_text(
            width - right + 6,
            axis,
            _seconds(lowest).split()[0] + "-" + _seconds(highest)
            if (lowest < 1) == (highest < 1)
            else f"{_seconds(lowest)}-{_seconds(highest)}",
            fill="#555",
            font_size="11",
        )
    )
    parts.append("</svg>")
    return "".join(parts)


def shared_range(values: list[float]) -> tuple[float, float]:
    """The strips' scale: from the 2nd to the 98th percentile of every node's values, so a
    node 1.2x slow spans most of a strip's height while a save's or an evaluation's one long
    step (drawn at the top) does not flatten the rest."""
    ordered = sorted(values)
    if not ordered:
        return 0.0, 1.0
    lo = ordered[int(0.02 * (len(ordered) - 1))]
    hi = ordered[math.ceil(0.98 * (len(ordered) - 1))]
    if hi - lo < 1e-9:  # every node alike and steady: a flat line mid-strip
        return lo - (abs(lo) or 1.0) * 0.1, hi + (abs(hi) or 1.0) * 0.1
    return lo, hi


def _share(value: float, lo: float, hi: float) -> float:
    return min(max((value - lo) / (hi - lo), 0.0), 1.0)


def _seconds(value: float) -> str:
    """ "186 ms", "1.4 s": a step time, short."""
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.3g} s"
