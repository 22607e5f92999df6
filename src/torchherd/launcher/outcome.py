"""What an attempt ended as: its exit code, its first failure, and what the next attempt may
reuse. Read from the attempt's ended state, a frozen record the attempt hands over once every
node is done with it (``AttemptState``, ``result_of``): this module never sees the live
attempt. The decision of the exit code alone is a pure function (``exit_code_of``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import (
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_NEVER_EXITED,
    EXIT_NODE_NOT_READY,
    EXIT_OK,
    EXIT_SAVED,
)
from ..recovery.evidence import Evidence, judge
from ..recovery.failures import NodeState, first_named
from ..results import Failure, RunResult

NO_SNAPSHOT_AFTER = (
    "{asked} and no snapshot was reported committed after it (a script saves with "
    "torchherd.train, or reports its own save with torchherd.progress.saved(step, where)); "
    "the last snapshot stands"
)


def no_snapshot_after(why: str) -> str:
    """Why a job asked to save ended failed: ``why`` herd asked (a slow node's swap, nodes
    back to grow the job), or, when empty, a time limit."""
    asked = f"herd asked for a save ({why})" if why else "the time limit came"
    return NO_SNAPSHOT_AFTER.format(asked=asked)


@dataclass
class AttemptResult(RunResult):
    """A RunResult, plus what the job needs to decide the next attempt."""

    number: int = 0
    reusable: tuple[str, ...] = ()
    """Nodes whose agent link is alive and reported this attempt's end: the next attempt can
    run there in place."""
    unconfirmed: tuple[str, ...] = ()
    """Nodes where the end of this attempt could not be confirmed (cut off and not swept):
    no attempt may start there until a sweep confirms it."""
    stopped_by_agents: bool = False
    """Every node's agent ended the attempt because this launcher had gone silent."""
    saved: bool = False
    """A snapshot committed after the time-limit request was reported."""
    noticed: str = ""
    ranks_seen: frozenset[tuple[str, int]] = field(default_factory=frozenset)


def exit_code_of(
    states: Mapping[str, str],
    *,
    interrupted: bool,
    stopping: bool,
    saving: bool,
    saved: bool,
    stopped_by_agents: bool,
    never_exited: bool = False,
    saving_for: str = "",
) -> tuple[int, str, bool]:
    """(exit code, the reason when it needs one, whether someone else stopped the job).

    Every node stopped on its own agent's request while this launcher stopped nothing:
    `herd stop` did it, from elsewhere (interrupted, nothing to blame). A save herd asked for
    counts only once a snapshot committed after the request was reported (``saving_for``: why
    herd asked, empty for a time limit). ``never_exited``: the other ranks finished and herd
    ended a rank that never exited (the job finished)."""
    stopped_elsewhere = (
        not stopping
        and not stopped_by_agents
        and all(s == NodeState.STOPPED for s in states.values())
    )
    finished = all(s in (NodeState.SUCCEEDED, NodeState.STOPPED) for s in states.values())
    if saving and finished and saved:
        return EXIT_SAVED, "", False
    if all(state == NodeState.SUCCEEDED for state in states.values()):
        return EXIT_OK, "", False
    if interrupted or stopped_elsewhere:
        return EXIT_INTERRUPTED, "", stopped_elsewhere
    if never_exited:
        return EXIT_NEVER_EXITED, "", False
    if any(state == NodeState.NOT_STARTED for state in states.values()):
        return EXIT_NODE_NOT_READY, "", False
    return EXIT_JOB_FAILED, no_snapshot_after(saving_for) if saving and not saved else "", False


@dataclass(frozen=True)
class AttemptState:
    """An attempt as it ended, as Attempt.ended_state records it: all the outcome reads."""

    job_id: str
    number: int
    log_dir: Path | None
    states: Mapping[str, str]
    """host -> succeeded, failed, stopped, lost, not started."""
    reusable: tuple[str, ...]
    """Nodes that ended the attempt themselves and whose agent link is still alive."""
    unconfirmed: tuple[str, ...]
    interrupted: bool
    stopping: bool
    saving: bool
    saving_for: str
    """Why herd asked for the save (a swap, a growth); empty for a time limit."""
    saved_after_request: bool
    stopped_for_silence: bool
    first_failure: Failure | None
    hang_found: str | None
    never_exited: bool
    """The others finished and herd ended a rank that never exited."""
    behind: tuple[str, ...]
    """The ranks the looks named behind (empty: judged from the stacks here)."""
    evidence: Evidence
    """The stacks taken; saved where they are kept by ``result_of``."""
    steps: Mapping[int, int]
    """The hang watch's last steps per rank (for judging the stacks)."""
    max_step: int | None
    noticed: str
    ranks_seen: frozenset[tuple[str, int]]


def result_of(ended: AttemptState, duration: float) -> AttemptResult:
    """The attempt's result (its stacks written where they are kept): run off the event loop,
    since it writes files."""
    behind = list(ended.behind) or [b.line() for b in judge(ended.evidence.stacks, ended.steps)]
    stacks_dir = ended.evidence.save(behind)
    states = dict(ended.states)
    stopped_by_agents = ended.stopped_for_silence and not ended.interrupted
    code, reason, stopped_elsewhere = exit_code_of(
        states,
        interrupted=ended.interrupted,
        stopping=ended.stopping,
        saving=ended.saving,
        saving_for=ended.saving_for,
        saved=ended.saved_after_request,
        stopped_by_agents=stopped_by_agents,
        never_exited=ended.never_exited,
    )
    failure = None
    if code not in (EXIT_OK, EXIT_SAVED) and not stopped_elsewhere:
        failure = ended.first_failure
        if failure is not None and ended.hang_found and failure.rank is None:
            named = first_named(behind)
            if named is not None:
                host, rank = named
                failure = Failure(host, rank, None, None, failure.message, remedy=failure.remedy)
    return AttemptResult(
        job_id=ended.job_id,
        exit_code=code,
        node_status=states,
        first_failure=failure,
        duration=duration,
        log_dir=ended.log_dir,
        behind=tuple(behind),
        stacks_dir=stacks_dir,
        evidence_problems=tuple(ended.evidence.problems),
        hang=None if ended.never_exited else ended.hang_found,
        lost=tuple(h for h, s in states.items() if s == NodeState.LOST),
        max_step=ended.max_step,
        reason=reason,
        number=ended.number,
        reusable=ended.reusable,
        unconfirmed=ended.unconfirmed,
        stopped_by_agents=stopped_by_agents,
        saved=ended.saved_after_request,
        noticed=ended.noticed,
        ranks_seen=ended.ranks_seen,
    )
