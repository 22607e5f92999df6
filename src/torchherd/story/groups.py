"""The report page's view of a job run as replica groups (``herd launch --replica-groups``).

The record's ``groups`` (launcher/groups.py) hold, per group, its node, how many times it ran
and each outage: when it went down, the step the others had reached, the seconds until the
others committed their next step and until the group healed. The page draws one row per
group on the job's time axis, up while it ran and marked where it was out, and a table with
the same facts in numbers: what a user asks after a loss ("did the others keep going, how long
was the group out?").
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from .svg import OUTCOME_COLOURS, TimeAxis, duration, svg_open, svg_text

UP_COLOUR = OUTCOME_COLOURS["succeeded"]
OUT_COLOUR = OUTCOME_COLOURS["failed"]
NEVER_BACK_COLOUR = OUTCOME_COLOURS["stopped"]


def outages_of(group: dict[str, Any]) -> list[dict[str, Any]]:
    """A group's outages that carry a time; a record from an older herd may lack some keys."""
    found = group.get("outages")
    if not isinstance(found, list):
        return []
    return [o for o in found if isinstance(o, dict) and isinstance(o.get("down_at"), int | float)]


def _seconds(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, int | float) else "-"


def outage_text(outage: dict[str, Any], started: float) -> str:
    """One outage in words: when, at which step, and what it cost."""
    at = duration(outage["down_at"] - started)
    step = outage.get("steps_before")
    where = f" at step {step}" if isinstance(step, int) else ""
    healed = outage.get("healed_s")
    back = f"healed {_seconds(healed)} later" if healed is not None else "never came back"
    return (
        f"down {at} in{where}; the others' next commit {_seconds(outage.get('next_commit_s'))} "
        f"later; {back}"
    )


def groups_timeline(groups: Sequence[dict[str, Any]], start: float, end: float) -> str:
    """One row per group on the job's time axis: up, and each outage from the moment it went
    down until it healed (or to the end, in grey, when it never came back)."""
    width, left, right, row = 900, 110, 20, 34
    height = 36 + row * len(groups)
    axis = TimeAxis(start, end, width, left, right)
    x = axis.x
    parts = [svg_open(width, height, "replica groups over time")]
    for i, group in enumerate(groups):
        top = 10 + i * row
        name = f"group {group.get('group', i)}"
        parts.append(svg_text(8, top + 15, name, font_weight="bold"))
        tip = html.escape(f"{name} on {group.get('host')}")
        parts.append(
            f'<rect x="{left}" y="{top}" width="{axis.plot}" height="20" rx="3" '
            f'fill="{UP_COLOUR}"><title>{tip}</title></rect>'
        )
        for outage in outages_of(group):
            down = outage["down_at"]
            healed = outage.get("healed_s")
            back = down + healed if isinstance(healed, int | float) else end
            colour = OUT_COLOUR if isinstance(healed, int | float) else NEVER_BACK_COLOUR
            x0 = x(down)
            x1 = max(x(back), x0 + 2)
            tip = html.escape(outage_text(outage, start))
            parts.append(
                f'<rect class="outage" x="{x0:.1f}" y="{top}" width="{x1 - x0:.1f}" height="20" '
                f'fill="{colour}"><title>{tip}</title></rect>'
            )
    parts += [axis.line(height - 18), *axis.ends(height - 8), "</svg>"]
    return "".join(parts)


def group_rows(groups: Sequence[dict[str, Any]], started: float) -> list[list[str]]:
    """The table's rows: group, node, runs, exit code, each outage in words."""
    rows = []
    for i, group in enumerate(groups):
        outages = outages_of(group)
        code = group.get("exit_code")
        rows.append(
            [
                str(group.get("group", i)),
                # Every node it ran on: a spare that took a lost node's place shows as a move.
                " → ".join(map(str, group.get("hosts") or [group.get("host", "?")])),
                str(group.get("runs", "-")),
                "-" if code is None else str(code),
                "; ".join(outage_text(o, started) for o in outages) or "none",
            ]
        )
    return rows
