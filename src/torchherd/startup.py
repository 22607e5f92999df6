"""Where the start of an attempt went: from the command (or, for a restart, the moment herd
saw the attempt before end) to the job's first step, phase by phase, per node and for the job.

A start passes marks, each a moment on this launcher's monotonic clock, per node:

    mark          phase it ends          measured by
    launcher      launcher start         the launcher process's start (imports, config)
    connected     ssh connect            the transport's connect (an ssh master per node)
    agent         agent start            the agent's own word: how long before its probe
                                         answer it was ready to read
    probed        probe                  the probe's answer arriving
    stopped       stop                   a restart: the node confirmed the last attempt ended
    requested     plan | replan          the run request sent (the plan made, the record kept)
    ready         wrapper warm           torchrun's wrapper has torch imported (agent marks)
    workers       rendezvous             the node's last worker interpreter started
    pg-begin      script start           its last rank called init_process_group
    pg-end        process-group init     ... and got it back
    first-step    first step             its last rank's first progress.beat(step)

Marks from the node (``ready`` onwards) are read on the node's wall clock and placed on the
launcher's by the attempt's "started" event: its time on the node against its arrival here, so
clocks that disagree between machines do not matter (the event's transit, milliseconds, does).

A node's phase is the time from its previous mark to this one; a mark a node lacks (a script
that never calls init_process_group, a start that failed) merges its phase into the next one
("script start + process-group init + first step"). The job's marks are the latest node's,
so the job's phases sum to its total: the time from the command to the moment the last rank
made its first step. Each phase names its slowest node: the one that took longest in it, or,
in a phase every node waits through for the others (plan, rendezvous), the one that arrived
last.
"""

from __future__ import annotations

import os
import time
from typing import Any

FIRST_START = (
    "launcher", "connected", "agent", "probed", "requested", "ready", "workers", "pg-begin",
    "pg-end", "first-step",
)  # fmt: skip
RESTART = ("stopped", "requested", "ready", "workers", "pg-begin", "pg-end", "first-step")

PHASE_OF = {
    "launcher": "launcher start",
    "connected": "ssh connect",
    "agent": "agent start",
    "probed": "probe",
    "stopped": "stop",
    "requested": "plan",
    "ready": "wrapper warm",
    "workers": "rendezvous",
    "pg-begin": "script start",
    "pg-end": "process-group init",
    "first-step": "first step",
}
# Phases every node waits through until the last one arrives: the slowest is the last in.
WAITED_FOR = {"requested", "workers"}
# The marks a node's agent sends (progress.mark), against the "started" event's clock.
NODE_MARKS = ("ready", "workers", "pg-begin", "pg-end", "first-step")
# The worker's marks on the node (worker_start) under the names the phases use.
NODE_MARK_NAMES = {"worker": "workers"}


def process_started(clock_now: float | None = None) -> float | None:
    """When this process started, on the monotonic clock (Linux: /proc; else None)."""
    try:
        with open("/proc/self/stat") as handle:
            fields = handle.read().rpartition(")")[2].split()
        ticks = int(fields[19])  # starttime: field 22 of stat, the 20th after the name
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        now = time.monotonic() if clock_now is None else clock_now
        return now - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def node_marks(events: dict[str, float], node_started: float, arrived: float) -> dict[str, float]:
    """A node agent's marks (its wall clock) on this launcher's clock: ``node_started`` is
    the "started" event's time on the node, ``arrived`` when it arrived here."""
    offset = arrived - node_started
    placed: dict[str, float] = {}
    for name, when in events.items():
        name = NODE_MARK_NAMES.get(name, name)
        if name in NODE_MARKS and isinstance(when, int | float):
            placed[name] = float(when) + offset
    return placed


def breakdown(
    origin: float, marks: dict[str, dict[str, float]], order: tuple[str, ...], *, restart: bool
) -> dict[str, Any]:
    """The start's phases from ``origin`` (the launcher's clock) and each node's ``marks``:
    {"total", "complete", "phases": {phase: s}, "slowest": {phase: host},
    "nodes": {host: {phase: s}}} (phases in the order they ran; seconds rounded to ms)."""
    names = {m: PHASE_OF[m] for m in order}
    if restart:
        names["requested"] = "replan"
    nodes: dict[str, dict[str, float]] = {}
    own: dict[str, dict[str, float]] = {}  # host -> mark -> its phase's seconds
    arrived_at: dict[str, dict[str, float]] = {}  # host -> mark -> the previous mark's time
    for host, found in marks.items():
        last, pending, phases = origin, [], {}
        for mark in order:
            if mark not in found:
                pending.append(mark)  # missing: merged into the next
                continue
            at = max(found[mark], last)  # a mark a hair early (clocks, transit) takes no time
            label = " + ".join(names[m] for m in [*pending, mark])
            phases[label] = at - last
            own.setdefault(host, {})[mark] = at - last
            arrived_at.setdefault(host, {})[mark] = last
            last, pending = at, []
        nodes[host] = {k: round(v, 3) for k, v in phases.items()}
    job: dict[str, float] = {}
    slowest: dict[str, str] = {}
    last, pending = origin, []
    for mark in order:
        reached = [found[mark] for found in marks.values() if mark in found]
        if not reached:
            pending.append(mark)
            continue
        at = max(*reached, last)
        label = " + ".join(names[m] for m in [*pending, mark])
        job[label] = round(at - last, 3)
        timed = {h: o[mark] for h, o in own.items() if mark in o}
        if timed:
            if mark in WAITED_FOR:
                slowest[label] = max(timed, key=lambda h: arrived_at[h][mark])
            else:
                slowest[label] = max(timed, key=lambda h: timed[h])
        last, pending = at, []
    complete = bool(marks) and all(order[-1] in found for found in marks.values())
    return {
        "total": round(last - origin, 3),
        "complete": complete,
        "phases": job,
        "slowest": slowest,
        "nodes": nodes,
    }


def render(found: dict[str, Any], attempt: int, restart: bool) -> list[str]:
    """The breakdown as lines for the console (herd launch -v)."""
    what = f"restart (attempt {attempt})" if restart else "start"
    ended = "to the first step" if found.get("complete") else "and no first step on every node"
    lines = [f"herd: {what}: {found['total']:.2f} s {ended}"]
    total = found["total"] or 1.0
    nodes = found.get("nodes", {})
    for phase, seconds in found["phases"].items():
        host = found["slowest"].get(phase) if len(nodes) > 1 else None  # one node: no contest
        mine = nodes.get(host, {}).get(phase) if host else None
        who = f"  slowest {host}" + (f" ({mine:.2f} s)" if mine is not None else "") if host else ""
        lines.append(f"  {phase:<28} {seconds:7.2f} s {100 * seconds / total:4.0f} %{who}")
    return lines


__all__ = ["FIRST_START", "RESTART", "breakdown", "node_marks", "process_started", "render"]
