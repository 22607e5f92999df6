"""The report page: one self-contained HTML file (inline CSS and SVG, nothing fetched).

From the top: the verdict (how the job ended, after how many restarts, its first failure with
cause and fix), the job's facts, the timeline of attempts and their table, the step rate per
attempt and node, loss and throughput from the metrics, then links to every log and stack.
Keys a newer record adds to an attempt are listed with it as they are.
"""

from __future__ import annotations

import html
import os
import re
import time
from pathlib import Path
from typing import Any

from .. import __version__
from ..hostlist import nodes_in_words
from ..noise import is_noise
from ..step_times import COMPUTE, WALL, WORK
from .gather import Story
from .groups import group_rows, groups_timeline
from .svg import OUTCOME_COLOURS, duration, line_chart, strips, timeline

# torch's prefix of every line a rank prints to stderr under torchrun (its --tee/--redirects).
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?", re.MULTILINE)

# Attempt keys the table shows in columns of their own; any other key is listed as it is.
KNOWN_KEYS = {
    "n", "started", "ended", "nodes", "world_size", "rdzv_endpoint", "how", "why", "outcome",
    "noticed", "failure", "behind", "stacks_dir", "max_step", "phases", "phases_slowest",
    "start_seconds", "start_complete",
}  # fmt: skip

STYLE = """
body{font-family:system-ui,sans-serif;max-width:64em;margin:1.5em auto;padding:0 1em;color:#222}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.6em;
border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0}td,th{padding:.25em .6em;text-align:left;
vertical-align:top;border-bottom:1px solid #eee}th{background:#f6f6f6}
.verdict{padding:.6em 1em;border-left:.45em solid;background:#f7f7f7;margin:1em 0}
.verdict p{margin:.3em 0}.fix{font-weight:bold}code,pre{font-family:ui-monospace,monospace;
font-size:.9em}pre{background:#f6f6f6;padding:.5em;overflow-x:auto}.note{color:#666}
.charts{display:flex;flex-wrap:wrap;gap:1em}.outcome{font-weight:bold}
"""


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def clock(timestamp: Any) -> str:
    if not isinstance(timestamp, int | float):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def table(header: list[str], rows: list[list[str]], raw: bool = False) -> str:
    """An HTML table; cells are escaped unless ``raw`` (cells already HTML)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{c if raw else esc(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def pairs(rows: list[list[str]]) -> str:
    """A two-column table of names and values, without a header."""
    body = "".join(f"<tr><th>{esc(name)}</th><td>{esc(value)}</td></tr>" for name, value in rows)
    return f"<table><tbody>{body}</tbody></table>"


class Links:
    """Hrefs to the job's files: relative where the page sits in the job directory, else
    absolute file URIs."""

    def __init__(self, page: Path) -> None:
        self.base = page.resolve().parent

    def href(self, path: Path) -> str:
        target = path.resolve()
        if self.base == target.parent or self.base in target.parents:
            return os.path.relpath(target, self.base)
        return target.as_uri()

    def a(self, path: Path, text: str | None = None) -> str:
        return f'<a href="{esc(self.href(path))}">{esc(text or path.name)}</a>'


def render(story: Story, page: Path) -> str:
    links = Links(page)
    record = story.record
    title = f"herd job {record.id}" + (f" ({record.name})" if record.name else "")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        _verdict(story),
        _facts(story),
        _attempts(story, links),
        _step_times(story),
        _groups(story),
        _phases(story),
        _rates(story),
        _metrics(story),
        _failure(story, links),
        _files(story, links),
        f'<p class="note">Made by herd report (torchherd {esc(__version__)}) on '
        f"{esc(clock(story.made))} from the job's record and logs in {esc(record.log_dir)}."
        "</p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _ended_how(story: Story) -> tuple[str, str]:
    record = story.record
    restarts = record.restarts or max(0, len(story.attempts) - 1)
    after = f" after {restarts} restart(s)" if restarts else ""
    state = record.state
    colour = OUTCOME_COLOURS.get(state, "#888")
    if state == "running":
        return f"still running{after}", colour
    code = f" (exit code {record.exit_code})" if record.exit_code is not None else ""
    return f"{state}{after}{code}", colour


def _verdict(story: Story) -> str:
    how, colour = _ended_how(story)
    record = story.record
    took = duration((record.ended or story.made) - record.started)
    lines = [f'<p class="outcome" id="verdict">Job {esc(record.id)} {esc(how)} in {esc(took)}.</p>']
    failure = story.first_failure
    if failure:
        lines.append(f"<p>First failure: {esc(headline(failure))}</p>")
        if failure.get("cause"):
            lines.append(f"<p>Cause: {esc(failure['cause'])}</p>")
        if failure.get("remedy"):
            lines.append(f'<p class="fix">Fix: {esc(failure["remedy"])}</p>')
    return f'<div class="verdict" style="border-color:{colour}">{"".join(lines)}</div>'


def headline(failure: dict[str, Any]) -> str:
    """ "node2 rank 3: exit code 1: ValueError: ..." from a failure record."""
    where = str(failure.get("host") or "the job")
    if failure.get("rank") is not None:
        where += f" rank {failure['rank']}"
    if failure.get("signal"):
        how = f"killed by {failure['signal']}"
    elif failure.get("exitcode") is not None:
        how = f"exit code {failure['exitcode']}"
    else:
        how = ""
    return ": ".join(bit for bit in (where, how, error_line(failure)) if bit)


def error_line(failure: dict[str, Any]) -> str:
    """What the failing rank said: the record's message, else the last line of its stderr
    (a Python traceback ends with the exception, ``ValueError: bad value 42``)."""
    message = unprefixed(str(failure.get("message") or "")).strip().splitlines()
    if message:
        return message[0]
    tail = failure.get("stderr_tail")
    lines = (
        [str(line).strip() for line in tail if str(line).strip()] if isinstance(tail, list) else []
    )
    return unprefixed(lines[-1]) if lines else ""


def unprefixed(text: str) -> str:
    """``text`` without torch's ``[rank1]:`` at the start of its lines: the page names the
    rank already."""
    return RANK_PREFIX.sub("", text)


def stderr_shown(tail: list[Any]) -> list[str]:
    """The stderr tail as the page shows it: torch's known chatter (c10d's reverse lookup, C++
    frames) left out, as on the console, and the rank prefix dropped."""
    return [unprefixed(str(line)) for line in tail if not is_noise(str(line), after_verdict=False)]


def _facts(story: Story) -> str:
    record = story.record
    nodes = nodes_in_words((str(n.get("host")), n.get("nproc")) for n in record.nodes)
    rows = [
        ["command", record.what or " ".join(record.command)],
        ["nodes", nodes or "-"],
        ["world size", str(record.world_size)],
        ["started", clock(record.started)],
        ["ended", clock(record.ended)],
        ["rendezvous", record.rdzv_endpoint or "this machine alone"],
        ["attempts", str(len(story.attempts) or 1)],
        ["cluster", record.source],
    ]
    return "<h2>The job</h2>" + pairs(rows)


def _attempts(story: Story, links: Links) -> str:
    if not story.attempts:
        return (
            "<h2>Attempts</h2><p class=note>This record has no attempts (written by an older "
            "herd): only the job as a whole is known.</p>"
        )
    record = story.record
    end = record.ended or story.made
    picture = timeline(story.attempts, record.started, end)
    rows = []
    for a in story.attempts:
        began, ended = a.get("started"), a.get("ended")
        took = (
            duration(ended - began)
            if isinstance(began, float | int) and isinstance(ended, float | int)
            else "-"
        )
        started = "first start" if a.get("how") == "first" else str(a.get("how") or "")
        if a.get("why"):
            started += f" after: {a['why']}"
        nodes = a.get("nodes") or []
        failure = a.get("failure") if isinstance(a.get("failure"), dict) else None
        stacks = a.get("stacks_dir")
        stack_cell = (
            links.a(Path(stacks), "stacks")
            if stacks and Path(stacks).exists()
            else (esc(stacks) if stacks else "-")
        )
        extra = {k: v for k, v in a.items() if k not in KNOWN_KEYS}
        rows.append(
            [
                esc(a.get("n")),
                esc(clock(began)),
                esc(took),
                esc(", ".join(str(n.get("host")) for n in nodes if isinstance(n, dict)) or "-"),
                esc(a.get("world_size", "-")),
                esc(started or "-"),
                f'<span style="color:{OUTCOME_COLOURS.get(str(a.get("outcome")), "#444")}">'
                f"{esc(a.get('outcome') or '-')}</span>",
                esc(a.get("noticed") or "-"),
                esc(headline(failure) if failure else "-")
                + "".join(f"<br>behind: {esc(line)}" for line in a.get("behind") or []),
                stack_cell,
                esc(a.get("max_step") if a.get("max_step") is not None else "-"),
                "<br>".join(f"{esc(k)}: {esc(_brief(v))}" for k, v in extra.items()) or "",
            ]
        )
    header = [
        "attempt", "started", "ran", "nodes", "world", "why it started", "outcome",
        "how herd noticed", "failure", "stacks", "last step", "more",
    ]  # fmt: skip
    return "<h2>Attempts</h2>" + picture + table(header, rows, raw=True)


def _brief(value: Any) -> str:
    """A record's value in words: a list (the slow ranks named, say) as its items, one
    after the other, never as Python's repr."""
    if isinstance(value, list | tuple):
        text = "; ".join(_brief(item) for item in value)
    elif isinstance(value, dict):
        text = ", ".join(f"{k} {_brief(v)}" for k, v in value.items())
    else:
        text = value if isinstance(value, str) else str(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _rates(story: Story) -> str:
    """Steps per second in each attempt, per node where the record says so, else for the
    job as a whole (its ranks step together)."""
    rows = []
    previous = 0
    for a in story.attempts:
        began, ended, step = a.get("started"), a.get("ended"), a.get("max_step")
        seconds = (
            ended - began
            if isinstance(began, int | float) and isinstance(ended, int | float)
            else None
        )
        job_rate = (
            (step - previous) / seconds
            if isinstance(step, int) and seconds and step >= previous
            else None
        )
        for node in a.get("nodes") or []:
            if not isinstance(node, dict):
                continue
            node_step = _first(node, "step", "max_step")
            node_rate = _first(node, "steps_per_s", "step_rate")
            if node_rate is not None:
                rate, whose = f"{node_rate:.2f}", "this node"
            elif job_rate is not None:
                rate, whose = f"≈ {job_rate:.2f}", "the job"
            else:
                rate, whose = "-", "no steps reported"
            last = node_step if node_step is not None else step
            rows.append(
                [
                    str(a.get("n", "-")),
                    str(node.get("host", "-")),
                    str(node.get("nproc", "-")),
                    str(last if last is not None else "-"),
                    rate,
                    whose,
                ]
            )
        if isinstance(step, int):
            previous = step
    if not rows:
        return ""
    return (
        "<h2>Step rate per node</h2>"
        + table(["attempt", "node", "workers", "last step", "steps/s", "measured for"], rows)
        + "<p class=note>Steps come from the ranks' progress beats (torchherd.train's Trainer "
        "beats every step; a plain script calls torchherd.progress.beat(step)). Where the record "
        "has no rate of a node's own, the job's is shown, marked ≈: the attempt's last step "
        "less the one before it, over the attempt's run time (a resume from an earlier snapshot "
        "makes it a little high). In data-parallel training every node steps together.</p>"
    )


def _phases(story: Story) -> str:
    """How each attempt's start was spent, where the record has it: an attempt's ``phases``,
    {phase: seconds} in the order they ran (connect, probe, plan, rendezvous, ...), with
    the slowest node of each (``phases_slowest``) and that node's own seconds in it."""
    rows = []
    for a in story.attempts:
        phases = a.get("phases")
        if not isinstance(phases, dict):
            continue
        found = a.get("phases_slowest")
        slowest: dict[str, Any] = found if isinstance(found, dict) else {}
        own = {
            str(n.get("host")): n["phases"]
            for n in a.get("nodes") or []
            if isinstance(n, dict) and isinstance(n.get("phases"), dict)
        }
        timed = {k: v for k, v in phases.items() if isinstance(v, int | float)}
        total = sum(timed.values())
        for name, seconds in timed.items():
            share = f"{100 * seconds / total:.0f} %" if total > 0 else "-"
            host = slowest.get(name)
            mine = own.get(str(host), {}).get(name)
            who = "-" if host is None else str(host)
            if isinstance(mine, int | float):
                who += f" ({mine:.2f} s)"
            rows.append([str(a.get("n", "-")), str(name), f"{seconds:.2f}", share, who])
        upto = "first step" if a.get("start_complete", True) else "as far as it got"
        rows.append([str(a.get("n", "-")), f"total (to the {upto})", f"{total:.2f}", "100 %", ""])
    if not rows:
        return ""
    return (
        "<h2>Start of each attempt</h2>"
        + table(["attempt", "phase", "seconds", "share", "slowest node (its own)"], rows)
        + "<p class=note>From the command (a restart: from the moment herd saw the attempt "
        "before end) to the moment the last rank made its first step. A phase every node waits "
        "through (plan, rendezvous) names the node that arrived last; the others, the node "
        "that took longest in it.</p>"
    )


def _groups(story: Story) -> str:
    """A job run as replica groups: each group's row over time and its outages in numbers."""
    groups = [g for g in story.record.groups if isinstance(g, dict)]
    if not groups:
        return ""
    start, end = story.record.started, story.record.ended or story.made
    return (
        "<h2>Replica groups</h2>"
        + groups_timeline(groups, start, end)
        + table(["group", "node", "runs", "exit code", "outages"], group_rows(groups, start))
        + "<p class=note>Each group trains on its own and the others go on without a group "
        "that is out (red, until it healed from a live group; grey: it never came back). "
        "The others' next commit: seconds from the loss to the next step the live groups "
        "committed.</p>"
    )


def _step_times(story: Story) -> str:
    """Each node's step time over the run, where the record has it: a node's
    ``step_times``, [[step, seconds, at], ...], in each attempt, drawn as one strip per node
    under the timeline, on its time axis (attempts joined; where herd named the node slow,
    ``named_slow_at``, marked)."""
    series: dict[str, list[tuple[float, float]]] = {}
    marks: dict[str, float] = {}
    measures: set[str] = set()
    for a in story.attempts:
        for node in a.get("nodes") or []:
            if not isinstance(node, dict) or not isinstance(node.get("step_times"), list):
                continue
            host = str(node.get("host", "?"))
            points = series.setdefault(host, [])
            for point in node["step_times"]:
                if (
                    isinstance(point, list | tuple)
                    and len(point) == 3
                    and all(isinstance(v, int | float) for v in point)
                ):
                    points.append((float(point[2]), float(point[1])))
            if isinstance(node.get("named_slow_at"), int | float):
                marks.setdefault(host, float(node["named_slow_at"]))
            measures.add(str(node.get("step_times_measure") or WORK))
    series = {host: points for host, points in series.items() if points}
    if not series:
        return ""
    record = story.record
    picture = strips(series, record.started, record.ended or story.made, marks)
    what = "; ".join(MEASURES.get(m, m) for m in sorted(measures))
    return (
        '<h2 id="step-times">Step time per node</h2>'
        + picture
        + f"<p class=note>Seconds per step of each node: {esc(what)}. One strip per node on "
        "the timeline's axis and one scale for all (the range under them, most of every "
        "node's values), so a slow node's strip sits higher; at the right, its latest (the "
        "median of its last five points). A red mark: where herd named the node slow.</p>"
    )


# What a node's step times measure (step_times.py), in words.
MEASURES = {
    WORK: "its slowest rank's work, the step less the time it waited for the others (in "
    "data-parallel training the wall time per step is the same on every node)",
    COMPUTE: "its slowest rank's forward passes",
    WALL: "wall time per step, from its step count (the same on every node of a "
    "synchronous job; the script reports no timings)",
}


def _first(mapping: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if isinstance(mapping.get(key), int | float):
            return mapping[key]
    return None


def _metrics(story: Story) -> str:
    metrics = story.metrics
    charts = []
    for key, label, colour, log in (
        ("loss", "loss", "#d1495b", True),
        ("samples_per_s", "throughput (samples/s)", "#3b7dd8", False),
        ("tokens_per_s", "throughput (tokens/s)", "#2a9d5c", False),
    ):
        points = metrics.series(key)
        if len(points) >= 2:
            charts.append(line_chart(points, label, colour, log=log))
    if not charts:
        why = metrics.found_by if metrics.path is None else f"{metrics.path} has no loss or rate"
        return f"<h2>Loss and throughput</h2><p class=note>No curves: {esc(why)}.</p>"
    return (
        "<h2>Loss and throughput</h2>"
        f'<div class="charts">{"".join(charts)}</div>'
        f"<p class=note>From {esc(metrics.path)} ({esc(metrics.found_by)}).</p>"
    )


def _failure(story: Story, links: Links) -> str:
    failure = story.first_failure
    if not failure:
        return ""
    rows = [
        ["where", f"{failure.get('host') or '-'} rank {failure.get('rank', '-')}"],
        [
            "exit",
            f"signal {failure['signal']}"
            if failure.get("signal")
            else f"exit code {failure.get('exitcode', '-')}",
        ],
        ["message", unprefixed(str(failure.get("message") or "")) or error_line(failure) or "-"],
        ["cause", str(failure.get("cause") or "not a known signature")],
        ["fix", str(failure.get("remedy") or "-")],
    ]
    rank = failure.get("rank")
    tail = failure.get("stderr_tail")
    said = (
        "<p>The last lines of its stderr:</p><pre>" + esc("\n".join(stderr_shown(tail))) + "</pre>"
        if isinstance(tail, list) and tail
        else ""
    )
    log = Path(story.record.log_dir) / f"rank-{rank}.log"
    see = f"<p>Its output: {links.a(log)}</p>" if rank is not None and log.exists() else ""
    return '<h2 id="first-failure">First failure</h2>' + pairs(rows) + said + see


def _files(story: Story, links: Links) -> str:
    record = story.record
    log_dir = Path(record.log_dir)
    items = []
    merged = log_dir / "output.log"
    if merged.exists():
        items.append(f"<li>{links.a(merged)}: every rank's lines, prefixed host:rank</li>")
    for path in story.rank_logs:
        items.append(f"<li>{links.a(path)}</li>")
    for node_log in sorted(log_dir.glob("node-*.log")):
        items.append(f"<li>{links.a(node_log)}</li>")
    stacks = []
    for attempt, files in story.stacks.items():
        summary = log_dir / "stacks" / attempt / "summary.json"
        entries = [links.a(f) for f in files]
        if summary.exists():
            entries.append(links.a(summary))
        stacks.append(f"<li>{esc(attempt)}: {', '.join(entries)}</li>")
    if record.detached and not items:
        items.append(
            f"<li>a detached job keeps its output on its nodes: <code>herd logs {esc(record.id)}"
            " --rank R</code></li>"
        )
    text = "<h2>Logs</h2><ul>" + ("".join(items) or "<li>none kept</li>") + "</ul>"
    if stacks:
        text += (
            "<h2>Stacks taken before herd stopped an attempt</h2><ul>" + "".join(stacks) + "</ul>"
        )
    return text
