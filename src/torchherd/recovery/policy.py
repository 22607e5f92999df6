"""The restart decision: after an attempt ends, stop the job (with an exit code and a reason) or
start the next attempt (on which nodes, and why). One pure function, ``RestartPolicy.decide``,
of what happened (``Ended``), the nodes at hand (``Bench``), what came before (``History``) and
the signals herd received (``Signals``); the job loop (job.py) gathers these, acts on the
``Decision`` and keeps its ``history`` for the next one. The rules, in the order they apply:

    finished     exit 0 -> stop, 0;  a snapshot committed after a time limit's request -> stop, 5;
                 the others finished and a rank never exited (herd ended it) -> stop, 6: the
                 work is done, a restart would only redo it
    signals      Ctrl-C/SIGTERM -> stop, 130; a time limit that came between attempts -> stop,
                 5 when the job has a committed snapshot, else the attempt's own exit code
    grow back    the workers saved and stopped because left-out nodes came back -> restart with
                 them (costs no restart)
    stalled      the agents stopped the job because this launcher went silent -> restart, not
                 counted, at most STALL_RESTARTS times
    not a fault  anything but a failed run (nodes not ready, interrupted, ...) -> stop as it is
    budget       ``max_restarts`` restarts done -> stop with the failure
    crash loop   ``crash_loop`` restarts in a row without step progress -> stop, 4
    nodes        the next attempt's nodes (recovery.nodes.choose_nodes): in place when every node
                 answered and none was lost; a spare in a lost node's place; fewer nodes when
                 ``min_nodes`` allows; nodes that came back join again. A lost node the job
                 cannot go on without is swept first (``SWEEP``: it may answer again); still
                 silent after the sweep -> stop, with what to do
    set aside    a node named as the first failure of SET_ASIDE_AFTER attempts in a row is
                 treated like a lost one when a spare or ``min_nodes`` lets the job go on
                 without it (else it stays: the crash loop rule ends a job that cannot)
    come back    a left-out node is looked at again (pool.NodePool) after comeback_delay():
                 at once the first time, then a growing backoff for a node that flaps

herd restarts, not torchrun (torchrun counts restarts per node and desynchronises the store
prefixes): every node stops and the whole job starts again with a fresh rendezvous. The budget
counts per job, never per node.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ..errors import (
    EXIT_CRASH_LOOP,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_NEVER_EXITED,
    EXIT_OK,
    EXIT_SAVED,
)
from .nodes import NodeChoice, choose_nodes

# An attempt without step information that ran this long counts as progress (a plain script
# that prints no step numbers and fails after an hour is not crash-looping).
PROGRESS_BY_TIME = 300.0
# Restarts after the agents stopped the job for a silent launcher (this launcher was stopped
# or suspended): not the job's fault, so not counted against max_restarts, but bounded.
STALL_RESTARTS = 3
# Attempts in a row a node is named as the first failure before it is set aside.
SET_ASIDE_AFTER = 2
# A node left out again (it flaps) waits before it is looked at: COMEBACK_BASE s the second
# time, twice as long each time after, at most COMEBACK_MAX s.
COMEBACK_BASE = 60.0
COMEBACK_MAX = 900.0


@dataclass(frozen=True)
class Ended:
    """What the decision reads of the attempt that just ended."""

    exit_code: int
    nodes: tuple[str, ...]
    """The attempt's nodes, in its plan's order."""
    lost: frozenset[str] = frozenset()
    """Its nodes that may not be used as they are: lost, or their end unconfirmed."""
    reusable: frozenset[str] = frozenset()
    """Its nodes whose agent is alive and reported the end: an in-place restart can use them."""
    max_step: int | None = None
    seconds: float = 0.0
    growing: str = ""
    """Why the workers were asked to save and stop so that the job grows, or so that a slow
    node is swapped out ("" if not)."""
    swap_out: tuple[str, ...] = ()
    """Nodes to leave out because they stayed slow (--swap-slow), where the job can go on
    without them (a spare takes their place, or --min-nodes allows)."""
    stopped_by_agents: bool = False
    failed_host: str | None = None
    """The node of the first failure, when one is named."""
    cause: str = ""
    """The first failure in one line (said when restarting)."""


@dataclass(frozen=True)
class Bench:
    """The nodes the next attempt may use, beyond the last attempt's."""

    order: tuple[str, ...]
    """Every node of the cluster, in its order."""
    size: int
    """The job's full node count (spares aside)."""
    nproc: Mapping[str, int] = field(default_factory=dict)
    """Workers per node (a spare replaces a node with as many)."""
    spares: tuple[str, ...] = ()
    """Idle spares that answer now (a spare whose agent stopped answering is not here)."""
    returned: tuple[str, ...] = ()
    """Left-out nodes that came back, were swept and checked, and are ready to join."""
    swept: frozenset[str] | None = None
    """After a SWEEP decision: the waited-for nodes the sweep found answering (None: no sweep
    yet)."""


@dataclass(frozen=True)
class History:
    """What the earlier attempts leave for the decision; a Decision carries the next one."""

    restarts: int = 0
    """Restarts counted against max_restarts."""
    stall_restarts: int = 0
    best_step: int | None = None
    no_progress: int = 0
    """Restarts in a row that got no further than the best step before them."""
    saves_seen: bool = False
    """The job has reported a committed snapshot."""
    failed_in_a_row: tuple[tuple[str, int], ...] = ()
    """(node, attempts in a row it was the first failure of)."""

    def streak(self, host: str) -> int:
        return dict(self.failed_in_a_row).get(host, 0)


@dataclass(frozen=True)
class Signals:
    interrupted: bool = False
    """Ctrl-C, SIGTERM or SIGHUP came."""
    time_limit: bool = False
    """SIGUSR1 came (during the attempt, or between attempts)."""
    limit_between: bool = False
    """The time limit came while no attempt was running (it could not be asked to save)."""

    @property
    def any(self) -> bool:
        return self.interrupted or self.time_limit


class Action(enum.Enum):
    STOP = "stop"
    RESTART = "restart"
    SWEEP = "sweep"
    """Sweep ``Decision.sweep`` (which tells whether they answer), then decide again with
    ``Bench.swept`` set."""


@dataclass(frozen=True)
class Decision:
    action: Action
    history: History
    """The history after this decision (the job keeps it only from the decision it acts on)."""
    exit_code: int | None = None
    """STOP: the job's exit code (None: the attempt's own)."""
    reason: str = ""
    """STOP: why the job gave up, for the summary ("" when the outcome says it)."""
    fix: str = ""
    """STOP: what to do about it, when the reason needs one."""
    say: bool = False
    """STOP: the reason is said on the console at once, not only in the summary."""
    why: str = ""
    """RESTART: why the job restarts, in one line."""
    counted: bool = False
    """RESTART: it counts against max_restarts."""
    choice: NodeChoice | None = None
    """RESTART: the next attempt's nodes."""
    in_place: bool = False
    """RESTART: the same nodes, through the same agents (no new plan)."""
    set_aside: tuple[str, ...] = ()
    """RESTART: nodes left out for failing attempts in a row (not lost: they answer)."""
    sweep: tuple[str, ...] = ()
    """SWEEP: the lost nodes the job cannot go on without."""


def comeback_delay(times_left_out: int) -> float:
    """Seconds a node left out for the ``times_left_out``-th time waits before herd looks at
    it again: none the first time (a node that was down once comes back as soon as it
    answers), then a growing backoff, so a flapping node does not use up the job's restarts
    and snapshots coming and going."""
    if times_left_out <= 1:
        return 0.0
    return min(COMEBACK_MAX, COMEBACK_BASE * 2 ** (times_left_out - 2))


def made_progress(best_before: int | None, best_now: int | None, seconds: float) -> bool:
    """Whether an attempt moved the job forward: a higher step than any attempt before it, or,
    without step numbers at all, a long enough run."""
    if best_now is not None:
        return best_before is None or best_now > best_before
    return best_before is None and seconds >= PROGRESS_BY_TIME


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 0
    """Times the whole job is restarted after a failure."""
    min_nodes: int | None = None
    """Go on without lost nodes while at least this many remain (None: every node needed)."""
    crash_loop: int = 3
    """Restarts in a row without step progress after which herd gives up (exit 4)."""

    def decide(
        self, ended: Ended, bench: Bench, history: History, signals: Signals = Signals()
    ) -> Decision:
        """The job's next step after ``ended`` (see the module's docstring for the rules)."""
        code = ended.exit_code
        history = replace(history, failed_in_a_row=_streaks(history, ended))

        def stop(
            exit_code: int | None = None, reason: str = "", fix: str = "", say: bool = False
        ) -> Decision:
            return Decision(Action.STOP, history, exit_code, reason, fix, say)

        if code in (EXIT_OK, EXIT_NEVER_EXITED) or (
            code == EXIT_SAVED and not (ended.growing and not signals.any)
        ):
            return stop()
        if signals.interrupted:
            return stop(EXIT_INTERRUPTED)
        if signals.time_limit:
            if not signals.limit_between:
                return stop()  # the attempt was asked to save: its own outcome says how
            if history.saves_seen:
                return stop(
                    EXIT_SAVED,
                    "the time limit came while the job was restarting; no attempt was started "
                    "after it: the last committed snapshot stands",
                    say=True,
                )
            return stop(
                None,
                "the time limit came while the job was restarting; no attempt was started "
                "after it and the job never reported a committed snapshot",
                say=True,
            )
        if code == EXIT_SAVED:  # saved and stopped for nodes that came back: grow
            return self._grow(ended, bench, history)
        if ended.stopped_by_agents and history.stall_restarts < STALL_RESTARTS:
            history = replace(history, stall_restarts=history.stall_restarts + 1)
            return self._restart(
                ended,
                bench,
                history,
                "the agents stopped the job while this launcher was not running",
                counted=False,
            )
        if code != EXIT_JOB_FAILED:
            return stop()
        if history.restarts >= self.max_restarts:
            if self.max_restarts == 0:
                return stop()
            return stop(
                None,
                f"the restart budget is spent ({history.restarts} of {self.max_restarts})",
                "fix the first failure above, or allow more restarts (--max-restarts N)",
            )
        progressed = made_progress(history.best_step, ended.max_step, ended.seconds)
        no_progress = 0 if progressed else history.no_progress + (1 if history.restarts else 0)
        best = history.best_step
        if ended.max_step is not None:
            best = max(best or 0, ended.max_step)
        history = replace(history, best_step=best, no_progress=no_progress)
        if no_progress >= self.crash_loop:
            return stop(
                EXIT_CRASH_LOOP,
                f"crash loop: {no_progress} restart(s) in a row failed without step progress "
                f"(best step {best if best is not None else 'none'}); fix the first failure "
                "above, restarting will not",
            )
        history = replace(history, restarts=history.restarts + 1)
        return self._restart(ended, bench, history, ended.cause or "a node failed", counted=True)

    def _grow(self, ended: Ended, bench: Bench, history: History) -> Decision:
        """The workers saved and stopped so that nodes that came back join: a restart that
        costs none of the budget."""
        if ended.max_step is not None:
            history = replace(history, best_step=max(history.best_step or 0, ended.max_step))
        return self._restart(ended, bench, history, ended.growing, counted=False)

    def _restart(
        self, ended: Ended, bench: Bench, history: History, why: str, *, counted: bool
    ) -> Decision:
        current = ended.nodes
        lost = set(ended.lost)
        if bench.swept is not None:
            lost -= bench.swept
        grow = bool(bench.returned) and len(current) < bench.size
        set_aside = tuple(
            h
            for h in current
            if h not in lost and history.streak(h) >= SET_ASIDE_AFTER and h == ended.failed_host
        )
        if set_aside:
            trial = self._choose(bench, current, lost | set(set_aside))
            if trial.waiting:
                set_aside = ()  # the job cannot go on without it: it stays (crash loop rule)
        slow = tuple(h for h in ended.swap_out if h in current and h not in lost)
        if slow and not self._choose(bench, current, lost | {*set_aside, *slow}).waiting:
            set_aside += slow  # else nothing can take its place: it stays
        if not lost and not grow and not set_aside and set(current) <= set(ended.reusable):
            return Decision(
                Action.RESTART,
                history,
                why=why,
                counted=counted,
                choice=NodeChoice(tuple(current)),
                in_place=True,
            )
        choice = self._choose(bench, current, lost | set(set_aside))
        if choice.waiting:
            if bench.swept is None:
                return Decision(Action.SWEEP, history, sweep=choice.waiting)
            left = len(current) - len(choice.waiting)
            needed = self.min_nodes or bench.size
            return Decision(
                Action.STOP,
                history,
                None,
                f"{', '.join(choice.waiting)} still do(es) not answer: {left} node(s) left, "
                f"{needed} needed",
                "bring the node back, or allow going on with fewer nodes (--min-nodes M, or "
                "min_nodes in [cluster]), or keep a spare (spare = true on a [[node]], or "
                "--spares N)",
            )
        failing = [h for h in set_aside if h not in slow]
        if failing:
            aside = ", ".join(failing)
            why = f"{why}; {aside} failed {SET_ASIDE_AFTER} attempts in a row: set aside"
        return Decision(
            Action.RESTART, history, why=why, counted=counted, choice=choice, set_aside=set_aside
        )

    def _choose(self, bench: Bench, current: tuple[str, ...], lost: set[str]) -> NodeChoice:
        return choose_nodes(
            bench.order,
            current,
            lost,
            nproc=bench.nproc,
            spares=bench.spares,
            returned=bench.returned,
            min_nodes=self.min_nodes,
            size=bench.size,
        )


def _streaks(history: History, ended: Ended) -> tuple[tuple[str, int], ...]:
    """Each node's run of attempts in a row it was the first failure of, after ``ended``: a
    node named again adds one; every other node starts again from none."""
    if ended.exit_code != EXIT_JOB_FAILED or ended.failed_host is None:
        return ()
    host = ended.failed_host
    return ((host, history.streak(host) + 1),)
