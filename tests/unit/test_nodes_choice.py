"""The next attempt's nodes (recovery.nodes): in place, a spare in a lost node's place, fewer
nodes, nodes back in the job; and how an attempt's end becomes an exit code (outcome)."""

from __future__ import annotations

from typing import Any

from torchherd.errors import (
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_NEVER_EXITED,
    EXIT_OK,
    EXIT_SAVED,
)
from torchherd.launcher.outcome import exit_code_of
from torchherd.recovery.nodes import choose_nodes

ORDER = ["n1", "n2", "n3", "s1", "s2"]
ONE_EACH = {host: 1 for host in ORDER}


def test_a_lost_node_is_replaced_by_a_spare_with_as_many_workers() -> None:
    nproc = {**ONE_EACH, "n2": 4, "s1": 1, "s2": 4}
    choice = choose_nodes(ORDER, ["n1", "n2", "n3"], {"n2"}, nproc=nproc, spares=["s1", "s2"])
    assert choice.nodes == ("n1", "n3", "s2") and choice.replaced == (("n2", "s2"),)
    assert not choice.left_out and not choice.waiting
    assert choice.describe() == "spare s2 takes n2's place: 3 node(s), rendezvous on n1"


def test_without_spare_the_job_goes_on_with_fewer_only_when_allowed() -> None:
    fewer = choose_nodes(ORDER, ["n1", "n2", "n3"], {"n1"}, nproc=ONE_EACH, min_nodes=2)
    assert fewer.nodes == ("n2", "n3") and fewer.left_out == ("n1",)
    assert fewer.describe().endswith("rendezvous on n2")  # the first left hosts the store
    every = choose_nodes(ORDER, ["n1", "n2", "n3"], {"n1"}, nproc=ONE_EACH)
    assert every.waiting == ("n1",) and every.nodes == ("n1", "n2", "n3")
    too_few = choose_nodes(ORDER, ["n1", "n2", "n3"], {"n1", "n2"}, nproc=ONE_EACH, min_nodes=2)
    assert too_few.waiting == ("n1", "n2")


def test_nodes_that_came_back_join_up_to_the_jobs_size() -> None:
    back = choose_nodes(ORDER, ["n2", "n3"], set(), nproc=ONE_EACH, returned=["n1"], size=3)
    assert back.nodes == ("n1", "n2", "n3") and back.added == ("n1",)
    full = choose_nodes(ORDER, ["n1", "n2", "n3"], set(), nproc=ONE_EACH, returned=["s1"], size=3)
    assert full.nodes == ("n1", "n2", "n3") and not full.added and not full.changed


def test_a_spare_and_a_returned_node_together() -> None:
    choice = choose_nodes(
        ORDER,
        ["n2", "n3"],
        {"n3"},
        nproc=ONE_EACH,
        spares=["s1"],
        returned=["n1"],
        min_nodes=2,
        size=3,
    )
    assert choice.nodes == ("n1", "n2", "s1")
    assert choice.replaced == (("n3", "s1"),) and choice.added == ("n1",)


def test_the_exit_code_of_an_attempt() -> None:
    def outcome(states: dict[str, str], **flags: Any) -> tuple[int, str, bool]:
        base = dict(
            interrupted=False, stopping=False, saving=False, saved=False, stopped_by_agents=False
        )
        return exit_code_of(states, **{**base, **flags})

    def code(states: dict[str, str], **flags: Any) -> int:
        return outcome(states, **flags)[0]

    assert code({"a": "succeeded", "b": "succeeded"}) == EXIT_OK
    assert code({"a": "failed", "b": "stopped"}, stopping=True) == EXIT_JOB_FAILED
    assert code({"a": "stopped", "b": "stopped"}, interrupted=True, stopping=True) == (
        EXIT_INTERRUPTED
    )
    # Stopped by `herd stop` from elsewhere: nothing to blame.
    assert outcome({"a": "stopped"})[1:] == ("", True)
    # A time limit: exit 5 only with a snapshot committed after the request.
    saved = {"a": "succeeded", "b": "stopped"}
    assert code(saved, saving=True, saved=True, stopping=True) == EXIT_SAVED
    failed, reason, _ = outcome(saved, stopping=True, saving=True)
    assert failed == EXIT_JOB_FAILED and "no snapshot was reported committed" in reason
    assert reason.startswith("the time limit came and "), reason
    # Asked for a slow node's swap: the reason says so, not a time limit.
    swap = "node2 is still slow: swapping it out"
    reason = outcome(saved, stopping=True, saving=True, saving_for=swap)[1]
    assert reason.startswith(f"herd asked for a save ({swap}) and "), reason
    # The agents stopped the job for a silent launcher: a failure to restart, not a stop.
    assert code({"a": "stopped", "b": "stopped"}, stopped_by_agents=True) == EXIT_JOB_FAILED
    # The others finished and herd ended a rank that never exited: the job finished (6);
    # Ctrl-C meanwhile still says interrupted.
    left = {"a": "succeeded", "b": "stopped"}
    assert code(left, stopping=True, never_exited=True) == EXIT_NEVER_EXITED
    assert code(left, stopping=True, interrupted=True, never_exited=True) == EXIT_INTERRUPTED
