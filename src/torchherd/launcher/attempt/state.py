"""What one running attempt knows: its nodes, the ranks heard from, their steps, its snapshots,
how it is ending, and what herd found. One mutable record (``LiveState``), written by the event
handlers (events.py), the watches (watch.py) and the actions (actions.py), and read by all of
them; when every node is done with the attempt it is frozen into an ``outcome.AttemptState``
(run.py), which is all the outcome, the report and the restart decision see.

Node states (recovery.failures.NodeState):
              starting -> running -> succeeded | failed | stopped | lost
              starting -> not started            (the agent could not start the attempt)

Nothing here does I/O or waits: each change is a plain method over plain values, so an event's
effect can be tested without a node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ...plan import LaunchPlan
from ...recovery.failures import NodeRun, NodeState, choose_first_failure, in_words
from ...results import Failure
from ...step_times import StepSeries, beat_seconds, limit_for


@dataclass
class LiveState:
    """One attempt as it runs, as this launcher knows it."""

    plan: LaunchPlan
    number: int = 0
    nodes: dict[str, NodeRun] = field(init=False)
    """host -> the node in this attempt (its NodeState, failures, error, whether it is done)."""

    # -- what herd found ---------------------------------------------------------------------
    cause: Failure | None = None
    """Set when herd itself found the cause (a lost node, a hang); wins over workers'."""
    hang_found: str | None = None
    never_exited: bool = False
    """The job's work finished, but a rank never exited (herd ended it)."""
    behind: tuple[str, ...] = ()
    noticed: str | None = None
    """How herd noticed what ended the attempt early, in words (for the job's story)."""
    trigger: str | None = None
    """The node whose failure made the attempt stop the others."""

    # -- progress ------------------------------------------------------------------------------
    ranks_seen: set[tuple[str, int]] = field(default_factory=set)
    node_steps: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """host -> [(when, step) first seen, (when, step) latest]: the node's step rate."""
    step_times: dict[str, StepSeries] = field(default_factory=dict)
    """host -> its step times over the attempt, bounded (step_times.py; the job record's)."""
    stepped_at: dict[str, float] = field(default_factory=dict)
    """host -> when (this launcher's clock) its ranks' step last went up."""
    quiet_said: set[str] = field(default_factory=set)
    """Nodes said to be quiet while the others still step (said once each)."""
    survivors: dict[str, list[int]] = field(default_factory=dict)
    """host -> processes of this attempt that outlived its agent's kill there: the node
    stays out of an in-place restart until a sweep finds them gone."""
    start_marks: dict[str, dict[str, float]] = field(init=False)
    """host -> its start's marks on this launcher's clock (startup.py): the run request
    sent, then its agent's marks from the wrapper's warm-up to the first step."""
    node_clock: dict[str, tuple[float, float]] = field(default_factory=dict)
    """host -> (its "started" event's time on the node, its arrival here)."""

    # -- snapshots -----------------------------------------------------------------------------
    saves: int = 0
    """Committed snapshots the workers reported (the job can save on request)."""
    save_asked_at: float | None = None
    saved_before: dict[int, float] = field(default_factory=dict)
    """rank -> the time of its last snapshot reported before the save was asked for."""
    saved_after_request: bool = False

    # -- how it ends ---------------------------------------------------------------------------
    stopping: bool = False
    """The nodes were told to stop (or to die)."""
    ending: bool = False
    """The attempt's end is under way (a stop, or the stacks gathered before one): nothing
    else may end it again."""
    ending_at: float | None = None
    """When this launcher first saw the attempt end (a node done, a stop asked): a
    restart's start is counted from here."""
    interrupted: bool = False
    saving: bool = False
    growing: str = ""
    """Why the workers were asked to save and stop to grow the job, if they were."""
    stopped_for_silence: bool = False
    """The agents stopped the attempt because this launcher had gone silent."""

    def __post_init__(self) -> None:
        self.nodes = {p.host: NodeRun(p) for p in self.plan.nodes}
        self.start_marks = {h: {} for h in self.nodes}

    def running(self) -> list[str]:
        """The nodes whose workers run and whose share of the attempt is not over."""
        return [h for h, n in self.nodes.items() if n.state == NodeState.RUNNING and not n.done]

    def all_done(self) -> bool:
        return all(n.done for n in self.nodes.values())

    def ending_seen(self) -> None:
        if self.ending_at is None:
            self.ending_at = time.monotonic()

    def spoke(self, host: str, rank: int) -> None:
        self.ranks_seen.add((host, rank))

    def stepped(self, host: str, step: object, at: object, now: float) -> None:
        """A node's first and latest step, and when (its step rate, for the job's story).
        When is the beat's own time, not its arrival: a node's events can arrive in bursts;
        ``now`` (this launcher's clock) is when a step that went up was heard."""
        if isinstance(step, int) and isinstance(at, int | float):
            latest = self.node_steps.get(host, [(at, -1), (at, -1)])[1][1]
            if step > latest:
                self.stepped_at[host] = now
            first = self.node_steps.setdefault(host, [(at, step), (at, step)])[0]
            self.node_steps[host] = [first, (at, max(step, self.node_steps[host][1][1]))]

    def reported(self, host: str, beats: list[list[Any]], now: float, wall: float) -> None:
        """A node's report of its ranks' newest beats ([rank, step, at, compute, wait, cycle,
        ...], at least four items each): the node's highest step (``stepped``, heard at
        ``now`` on this launcher's clock), and one point of its step time at that step, its
        slowest rank's work per step (the rank the node holds the others back with), placed
        at ``wall`` (this machine's time of day)."""
        highest: list[Any] | None = None
        slowest: tuple[float, str] | None = None
        for beat in beats:
            step = beat[1]
            if isinstance(step, int) and (highest is None or step > highest[1]):
                highest = beat
            wait, cycle = (beat[4], beat[5]) if len(beat) >= 6 else (None, None)
            timed = beat_seconds(beat[3], wait, cycle)
            if timed is not None and (slowest is None or timed > slowest):
                slowest = timed
        if highest is None:
            return
        self.stepped(host, highest[1], highest[2], now)
        series = self.step_times.get(host) or StepSeries(limit_for(len(self.nodes)))
        self.step_times[host] = series
        series.add(highest[1], highest[2], wall, slowest)

    def step_rates(self) -> dict[str, tuple[int, float | None]]:
        """host -> (latest step, steps per second over the attempt, when known)."""
        rates: dict[str, tuple[int, float | None]] = {}
        for host, ((t0, s0), (t1, s1)) in self.node_steps.items():
            # Beats are sampled (one per half second at most): one step seen is no rate.
            known = t1 - t0 >= 1.0 and s1 > s0
            rates[host] = (s1, (s1 - s0) / (t1 - t0) if known else None)
        return rates

    def snapshot_saved(self, rank: int, at: float) -> bool:
        """A rank reported a committed snapshot made at ``at`` (its own clock); True when it
        is one made after the save was asked for (not the last one from before the ask)."""
        self.saves += 1
        if self.save_asked_at is None:
            self.saved_before[rank] = at
            return False
        if at != self.saved_before.get(rank):
            self.saved_after_request = True
            return True
        return False

    def first_failure(self) -> Failure | None:
        """The failure that caused the others: herd's own finding (a lost node, a hang), else
        the workers' (see ``choose_first_failure``), with its cause in words when known."""
        nodes = list(self.nodes.values())
        failure = self.cause or choose_first_failure(nodes, self.trigger)
        if failure is None:
            return None
        return in_words(failure, nodes, self.plan.nodes, self.ranks_seen)
