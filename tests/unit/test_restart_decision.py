"""The restart decision (recovery.policy.RestartPolicy.decide): one row per rule of the README's
"When things fail", each a pure call over what an attempt ended as, the nodes at hand, the
history and the signals."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from torchherd.errors import (
    EXIT_CRASH_LOOP,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_NEVER_EXITED,
    EXIT_NODE_NOT_READY,
    EXIT_OK,
    EXIT_SAVED,
)
from torchherd.recovery.policy import (
    COMEBACK_MAX,
    PROGRESS_BY_TIME,
    STALL_RESTARTS,
    Action,
    Bench,
    Decision,
    Ended,
    History,
    RestartPolicy,
    Signals,
    comeback_delay,
    made_progress,
)

NODES = ("n1", "n2", "n3")
ORDER = (*NODES, "s1")
ONE_EACH = {h: 1 for h in ORDER}


def ended(code: int = EXIT_JOB_FAILED, **kw: object) -> Ended:
    base: dict[str, object] = dict(
        exit_code=code,
        nodes=NODES,
        reusable=frozenset(NODES),
        max_step=10,
        failed_host="n2",
        cause="n2 rank 1: exit code 1",
    )
    return Ended(**{**base, **kw})  # type: ignore[arg-type]


def bench(**kw: object) -> Bench:
    return Bench(**{**dict(order=ORDER, size=3, nproc=ONE_EACH), **kw})  # type: ignore[arg-type]


@dataclass
class Row:
    rule: str
    ended: Ended = field(default_factory=ended)
    policy: RestartPolicy = RestartPolicy(max_restarts=3)
    bench: Bench = field(default_factory=bench)
    history: History = History()
    signals: Signals = Signals()
    # what the decision must be
    action: Action = Action.RESTART
    exit_code: int | None = None
    nodes: tuple[str, ...] | None = None
    in_place: bool | None = None
    counted: bool | None = None
    sweep: tuple[str, ...] = ()
    said: str = ""


ROWS = [
    Row("a finished job stops with 0", ended(EXIT_OK), action=Action.STOP, exit_code=None),
    Row(
        "finished, but a rank never exited: stops (6), never restarted",
        ended(EXIT_NEVER_EXITED),
        action=Action.STOP,
        exit_code=None,
    ),
    Row(
        "a snapshot after the time limit's request: exit 5",
        ended(EXIT_SAVED),
        signals=Signals(time_limit=True),
        action=Action.STOP,
    ),
    Row(
        "a worker fails, every node answers: restart in place, counted",
        nodes=NODES,
        in_place=True,
        counted=True,
        said="n2 rank 1: exit code 1",
    ),
    Row(
        "a node whose agent did not report the end: a new plan on the same nodes",
        ended(reusable=frozenset({"n1", "n3"})),
        nodes=NODES,
        in_place=False,
    ),
    Row(
        "the restart budget is spent: stop with the failure",
        history=History(restarts=3),
        action=Action.STOP,
        said="restart budget is spent (3 of 3)",
    ),
    Row(
        "no restarts allowed: stop with the failure, nothing more to say",
        policy=RestartPolicy(max_restarts=0),
        action=Action.STOP,
    ),
    Row(
        "nodes not ready is not a failure to restart",
        ended(EXIT_NODE_NOT_READY),
        action=Action.STOP,
    ),
    Row(
        "Ctrl-C: stop with 130, even after a failure",
        signals=Signals(interrupted=True),
        action=Action.STOP,
        exit_code=EXIT_INTERRUPTED,
    ),
    Row(
        "a lost node with --min-nodes: go on without it, the next node hosts the rendezvous",
        ended(lost=frozenset({"n1"}), reusable=frozenset({"n2", "n3"})),
        policy=RestartPolicy(max_restarts=3, min_nodes=2),
        nodes=("n2", "n3"),
        in_place=False,
        said="going on without n1: 2 node(s), rendezvous on n2",
    ),
    Row(
        "a lost node without --min-nodes: sweep it first (it may answer)",
        ended(lost=frozenset({"n1"}), reusable=frozenset({"n2", "n3"})),
        action=Action.SWEEP,
        sweep=("n1",),
    ),
    Row(
        "a lost node that answers the sweep: restart with it (a new agent, a new plan)",
        ended(lost=frozenset({"n1"}), reusable=frozenset({"n2", "n3"})),
        bench=bench(swept=frozenset({"n1"})),
        nodes=NODES,
        in_place=False,
    ),
    Row(
        "a lost node still silent after the sweep: stop, saying what to do",
        ended(lost=frozenset({"n1"}), reusable=frozenset({"n2", "n3"})),
        bench=bench(swept=frozenset()),
        action=Action.STOP,
        said="n1 still do(es) not answer: 2 node(s) left, 3 needed",
    ),
    Row(
        "a lost node and a spare: the spare takes its place, the world size kept",
        ended(lost=frozenset({"n2"}), reusable=frozenset({"n1", "n3"})),
        bench=bench(spares=("s1",)),
        nodes=("n1", "n3", "s1"),
        said="spare s1 takes n2's place",
    ),
    Row(
        "a spare that stopped answering is not offered: without --min-nodes, a sweep",
        ended(lost=frozenset({"n2"}), reusable=frozenset({"n1", "n3"})),
        bench=bench(spares=()),
        action=Action.SWEEP,
        sweep=("n2",),
    ),
    Row(
        "grow back: the workers saved for nodes that came back; costs no restart",
        ended(EXIT_SAVED, nodes=("n2", "n3"), growing="n1 back: growing the job"),
        bench=bench(returned=("n1",)),
        history=History(restarts=3),
        nodes=NODES,
        counted=False,
        said="n1 back in the job",
    ),
    Row(
        "a job that never saved grows back at its next restart",
        ended(nodes=("n2", "n3"), reusable=frozenset({"n2", "n3"})),
        policy=RestartPolicy(max_restarts=3, min_nodes=2),
        bench=bench(returned=("n1",)),
        nodes=NODES,
        in_place=False,
        counted=True,
    ),
    Row(
        "a crash loop: K restarts in a row without step progress exit 4",
        history=History(restarts=2, best_step=10, no_progress=2),
        action=Action.STOP,
        exit_code=EXIT_CRASH_LOOP,
        said="crash loop: 3 restart(s) in a row failed without step progress (best step 10)",
    ),
    Row(
        "a restart that got further resets the crash loop",
        ended(max_step=11),
        history=History(restarts=2, best_step=10, no_progress=2),
        counted=True,
    ),
    Row(
        "the agents stopped the job for a silent launcher: restart, not counted",
        ended(stopped_by_agents=True),
        history=History(restarts=3),
        in_place=True,
        counted=False,
    ),
    Row(
        "... but only STALL_RESTARTS times",
        ended(stopped_by_agents=True),
        history=History(restarts=3, stall_restarts=STALL_RESTARTS),
        action=Action.STOP,
    ),
    Row(
        "a time limit between attempts with a committed snapshot: exit 5",
        history=History(saves_seen=True),
        signals=Signals(time_limit=True, limit_between=True),
        action=Action.STOP,
        exit_code=EXIT_SAVED,
        said="the time limit came while the job was restarting",
    ),
    Row(
        "a time limit between attempts without any snapshot: the failure stands",
        signals=Signals(time_limit=True, limit_between=True),
        action=Action.STOP,
        exit_code=None,
        said="never reported a committed snapshot",
    ),
    Row(
        "a time limit during an attempt that failed to save: the attempt's outcome stands",
        signals=Signals(time_limit=True),
        action=Action.STOP,
        exit_code=None,
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.rule for r in ROWS])
def test_the_restart_decision(row: Row) -> None:
    decision = row.policy.decide(row.ended, row.bench, row.history, row.signals)
    assert decision.action is row.action, decision
    if row.action is Action.STOP:
        assert decision.exit_code == row.exit_code
    if row.nodes is not None:
        assert decision.choice is not None and decision.choice.nodes == row.nodes
    if row.in_place is not None:
        assert decision.in_place is row.in_place
    if row.counted is not None:
        assert decision.counted is row.counted
        restarts = row.history.restarts + (1 if row.counted else 0)
        assert decision.history.restarts == restarts
    assert decision.sweep == row.sweep
    if row.said:
        words = " ".join([decision.why, decision.reason, _describe(decision)])
        assert row.said in words, words


def _describe(decision: Decision) -> str:
    return decision.choice.describe() if decision.choice is not None else ""


def test_the_decision_is_pure_and_the_history_is_only_the_returned_one() -> None:
    """A SWEEP decision and the one taken after the sweep start from the same history: the
    first counts nothing the second counts again."""
    policy = RestartPolicy(max_restarts=3)
    lost = ended(lost=frozenset({"n1"}), reusable=frozenset({"n2", "n3"}))
    first = policy.decide(lost, bench(), History())
    again = policy.decide(lost, bench(swept=frozenset({"n1"})), History())
    assert first.action is Action.SWEEP and again.action is Action.RESTART
    assert again.history.restarts == 1


def test_progress_is_a_higher_step_or_a_long_run_without_steps() -> None:
    assert made_progress(None, 5, 1)
    assert made_progress(40, 41, 1)
    assert not made_progress(40, 40, 10_000)
    assert not made_progress(None, None, 10)
    assert made_progress(None, None, PROGRESS_BY_TIME)


def test_a_crash_loop_is_counted_across_decisions() -> None:
    """Three restarts in a row that reach no further step end the job with exit 4 on the
    crash_loop-th; the first attempt's failure is not a restart and counts nothing."""
    policy = RestartPolicy(max_restarts=10, crash_loop=3)
    history = History()
    actions = []
    for _ in range(5):
        decision = policy.decide(ended(max_step=7), bench(), history)
        history = decision.history
        actions.append(decision.action)
        if decision.action is Action.STOP:
            assert decision.exit_code == EXIT_CRASH_LOOP
            break
    assert actions == [Action.RESTART] * 3 + [Action.STOP]
    assert history.restarts == 3 and history.best_step == 7


# ---------------------------------------------------------------------------------------------
# a node that fails attempts in a row, and one that flaps


def twice(host: str = "n2") -> History:
    """The history after ``host`` was the first failure of the attempt before."""
    return History(restarts=1, best_step=5, failed_in_a_row=((host, 1),))


def test_a_node_failing_twice_in_a_row_is_set_aside_with_min_nodes() -> None:
    policy = RestartPolicy(max_restarts=5, min_nodes=2)
    decision = policy.decide(ended(), bench(), twice())
    assert decision.action is Action.RESTART and not decision.in_place
    assert decision.set_aside == ("n2",)
    assert decision.choice is not None and decision.choice.nodes == ("n1", "n3")
    assert "n2 failed 2 attempts in a row: set aside" in decision.why


def test_a_node_failing_twice_in_a_row_gives_its_place_to_a_spare() -> None:
    decision = RestartPolicy(max_restarts=5).decide(ended(), bench(spares=("s1",)), twice())
    assert decision.set_aside == ("n2",)
    assert decision.choice is not None and decision.choice.nodes == ("n1", "n3", "s1")


def test_a_node_the_job_cannot_go_on_without_stays() -> None:
    """No spare, no --min-nodes: the node stays and the crash loop rule judges the job."""
    decision = RestartPolicy(max_restarts=5).decide(ended(), bench(), twice())
    assert decision.in_place and not decision.set_aside


def test_a_failure_on_another_node_starts_the_count_again() -> None:
    policy = RestartPolicy(max_restarts=5, min_nodes=2)
    decision = policy.decide(ended(failed_host="n3"), bench(), twice("n2"))
    assert decision.in_place and not decision.set_aside
    assert decision.history.failed_in_a_row == (("n3", 1),)
    once = policy.decide(ended(), bench(), History())
    assert once.in_place and once.history.streak("n2") == 1


def test_a_flapping_node_waits_longer_each_time() -> None:
    delays = [comeback_delay(n) for n in range(1, 8)]
    assert delays[0] == 0.0  # down once: back as soon as it answers
    assert delays[1] > 0 and all(a < b for a, b in zip(delays[1:5], delays[2:6], strict=True))
    assert max(delays) == COMEBACK_MAX


SWAP = "n2 is still slow 30 s after it was named: swapping it out"


def test_a_node_that_stayed_slow_gives_its_place_to_a_spare_at_no_cost() -> None:
    """--swap-slow: the workers saved and stopped; the next attempt runs without n2."""
    slow = ended(EXIT_SAVED, growing=SWAP, swap_out=("n2",), failed_host=None)
    decision = RestartPolicy(max_restarts=0).decide(slow, bench(spares=("s1",)), History())
    assert decision.action is Action.RESTART and not decision.in_place and not decision.counted
    assert decision.set_aside == ("n2",)
    assert decision.choice is not None and decision.choice.nodes == ("n1", "n3", "s1")
    assert decision.why.startswith(SWAP) and "attempts in a row" not in decision.why
    fewer = RestartPolicy(max_restarts=0, min_nodes=2).decide(slow, bench(), History())
    assert fewer.choice is not None and fewer.choice.nodes == ("n1", "n3")


def test_a_slow_node_nothing_can_replace_stays() -> None:
    slow = ended(EXIT_SAVED, growing=SWAP, swap_out=("n2",), failed_host=None)
    decision = RestartPolicy(max_restarts=0).decide(slow, bench(), History())
    assert decision.in_place and not decision.set_aside
