"""An attempt's live state and what changes it: agent events (events.py) and the watch's
verdicts (watch.py), each turned into state without a node. A real Attempt over a plan of
named hosts (nothing is started: no link is open, so no command leaves), fed the events an
agent sends."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.unit.test_first_failure import attempt_of, node
from torchherd.launcher.attempt.state import LiveState
from torchherd.plan import LaunchPlan
from torchherd.recovery.failures import NodeState
from torchherd.recovery.hang import Hang


def live(hosts: list[str]) -> LiveState:
    plans = tuple(node(h, "starting").plan for h in hosts)
    return LiveState(LaunchPlan("job", "10.0.0.1:29500", len(hosts), plans, None, 1.0))


def test_only_a_snapshot_made_after_the_ask_counts_as_saved_for_it() -> None:
    """A rank reports its committed snapshots; once herd asked for one, the snapshot it
    reported before (same time) is not the one asked for, a later one is."""
    state = live(["n1"])
    assert not state.snapshot_saved(0, 100.0)  # before any ask: remembered, no more
    state.save_asked_at = 150.0
    assert not state.snapshot_saved(0, 100.0)  # the old one, reported again
    assert not state.saved_after_request
    assert state.snapshot_saved(0, 160.0)
    assert state.saved_after_request and state.saves == 3


def test_a_step_heard_again_does_not_count_as_stepping() -> None:
    """stepped_at (what vouches for a quiet node's peers) moves only when the step goes up;
    the rate runs from the first step seen to the latest."""
    state = live(["n1"])
    state.stepped("n1", 5, 100.0, now=1.0)
    state.stepped("n1", 5, 100.5, now=2.0)
    assert state.stepped_at == {"n1": 1.0}
    state.stepped("n1", 9, 102.0, now=3.0)
    state.stepped("n1", "junk", 103.0, now=4.0)
    assert state.stepped_at == {"n1": 3.0}
    assert state.step_rates() == {"n1": (9, 2.0)}


def test_a_nodes_report_gives_its_highest_step_and_its_slowest_ranks_work() -> None:
    """One report of a node's ranks' newest beats: the node stepped to its highest step (at
    that beat's time), and its step time is its slowest rank's work per step, whether the
    rank timed its waits (cycle - wait) or only its compute; a report with no step in it
    records nothing."""
    state = live(["n1"])
    state.reported("n1", [[0, "junk", 99.0, None], [1, None, 99.5, 0.3]], now=0.5, wall=999.0)
    assert state.stepped_at == {} and "n1" not in state.step_times
    report = [
        [0, 4, 100.0, 0.2],  # compute only: 0.2 s
        [1, 5, 100.5, None, 0.1, 0.5, 0.0],  # waits timed: 0.5 - 0.1 = 0.4 s of work
        [2, "junk", 101.0, None],
    ]
    state.reported("n1", report, now=1.0, wall=1000.0)
    assert state.stepped_at == {"n1": 1.0}
    assert state.node_steps["n1"] == [(100.5, 5), (100.5, 5)]
    assert state.step_times["n1"].points() == [[5, 0.4, 1000.0]]


def test_a_word_about_another_attempt_changes_nothing(tmp_path: Path) -> None:
    attempt, output = attempt_of(tmp_path, ["n1", "n2"])
    n1 = attempt.state.nodes["n1"]
    line = {"e": "line", "r": 0, "l": 1, "s": "out", "t": "hello"}
    attempt.events.handle(n1, {**line, "a": 1})  # attempt 1's line; this is attempt 0
    attempt.events.handle(n1, {"e": "exit", "code": 0, "a": 1})
    assert not attempt.state.ranks_seen and n1.state == NodeState.STARTING and not n1.done
    attempt.events.handle(n1, {**line, "a": 0})
    output.close()
    assert attempt.state.ranks_seen == {("n1", 0)}


def test_a_node_that_cannot_start_ends_the_attempt_and_is_the_trigger(tmp_path: Path) -> None:
    attempt, output = attempt_of(tmp_path, ["n1", "n2"])
    state = attempt.state
    attempt.events.handle(state.nodes["n1"], {"e": "started", "at": 5.0})
    assert state.running() == ["n1"]
    error = {"e": "error", "message": "no torchrun", "remedy": "install torch"}
    attempt.events.handle(state.nodes["n2"], error)
    output.close()
    assert state.nodes["n2"].state == NodeState.NOT_STARTED and state.nodes["n2"].done
    assert state.trigger == "n2" and state.noticed == "a worker exited"
    assert state.ending and state.stopping  # n1 told to stop, its stacks first
    assert not attempt.actions.over.is_set()  # n1 has not ended yet
    attempt.events.handle(state.nodes["n1"], {"e": "exit", "code": -15, "stopped": True})
    assert attempt.actions.over.is_set()
    ended = attempt.ended_state()
    assert dict(ended.states) == {"n1": "stopped", "n2": "not started"}
    assert ended.first_failure is not None and ended.first_failure.host == "n2"


def test_every_node_succeeding_ends_the_attempt_with_no_failure(tmp_path: Path) -> None:
    attempt, output = attempt_of(tmp_path, ["n1", "n2"])
    for node_run in attempt.state.nodes.values():
        attempt.events.handle(node_run, {"e": "started", "at": 1.0})
        attempt.events.handle(node_run, {"e": "exit", "code": 0})
    output.close()
    ended = attempt.ended_state()
    assert attempt.actions.over.is_set() and not attempt.state.stopping
    assert set(ended.states.values()) == {"succeeded"} and ended.first_failure is None
    assert attempt.state.ending_at is not None  # a restart's start would count from here


def test_a_snapshot_after_a_time_limits_ask_is_said_and_counted(tmp_path: Path) -> None:
    attempt, output = attempt_of(tmp_path, ["n1"])
    n1 = attempt.state.nodes["n1"]

    async def limit_then_save() -> None:
        attempt.events.handle(n1, {"e": "saved", "r": 0, "at": 100.0, "step": 10})
        attempt.request_save(within=60)
        attempt.events.handle(n1, {"e": "saved", "r": 0, "at": 100.0, "step": 10})
        attempt.events.handle(n1, {"e": "saved", "r": 0, "at": 200.0, "step": 20, "where": "s3"})

    asyncio.run(limit_then_save())
    output.close()
    said = (tmp_path / "out").read_text()
    assert attempt.state.saving and attempt.state.saved_after_request
    assert "a snapshot of step 20 was committed (s3)" in said
    assert "step 10 was committed" not in said


def test_a_silent_node_is_lost_and_is_the_cause(tmp_path: Path) -> None:
    attempt, output = attempt_of(tmp_path, ["n1", "n2"])
    state = attempt.state
    attempt.watch.silent(state.nodes["n2"])
    output.close()
    assert state.nodes["n2"].state == NodeState.LOST and state.nodes["n2"].done
    assert state.cause is not None and state.cause.host == "n2"
    assert "n2 stopped answering at" in state.cause.message
    assert state.noticed == "n2 went silent" and state.ending
    assert attempt.ended_state().first_failure == state.cause


def test_a_rank_that_never_exited_is_a_finished_job_not_a_hang(tmp_path: Path) -> None:
    attempt, output = attempt_of(tmp_path, ["n1", "n2"])
    state = attempt.state
    behind = ("n2 rank 1: still running at _shutdown (threading.py:1590)",)
    found = Hang("finished, but n2 rank 1 never exited", behind=behind, finished=True)

    async def verdict() -> None:
        attempt.watch.hung(found)
        await asyncio.sleep(0)  # the stacks are gathered (no node runs: none to wait for)

    asyncio.run(verdict())
    output.close()
    assert state.never_exited and state.behind == behind
    assert state.noticed == "the others finished; a rank never exited"
    assert state.cause is not None and state.cause.message == found.reason
    assert state.stopping  # stopped once the stacks were taken


def test_each_nodes_step_time_is_its_slowest_ranks_work_from_its_beats(tmp_path: Path) -> None:
    """Beats events as an agent sends them ([rank, step, at, compute, wait, cycle, data]):
    a node's point is the work (step less wait) of its slowest rank, at its highest step."""
    attempt, output = attempt_of(tmp_path, ["n1", "n2"])
    nodes = attempt.state.nodes
    for second in range(3):
        at = 100.0 + second
        beats_n1 = [[0, 10 * second, at, None, 0.08, 0.2, 0.0], [1, 10 * second + 1, at, None,
                    0.1, 0.2, 0.0]]  # fmt: skip
        beats_n2 = [[2, 10 * second, at, None, 0.01, 0.2, 0.0], "junk"]  # n2: barely waits
        attempt.events.handle(nodes["n1"], {"e": "beats", "b": beats_n1})
        attempt.events.handle(nodes["n2"], {"e": "beats", "b": beats_n2})
    output.close()
    n1 = attempt.state.step_times["n1"].points()
    n2 = attempt.state.step_times["n2"].points()
    assert [p[:2] for p in n1] == [[1, 0.12], [11, 0.12], [21, 0.12]]
    assert [p[:2] for p in n2] == [[0, 0.19], [10, 0.19], [20, 0.19]]
    assert attempt.state.step_times["n2"].measure == "work"
