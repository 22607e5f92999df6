"""Which failure the summary blames, over recorded failure records (torchrun's, whole seconds)."""

from __future__ import annotations

from torchherd.plan import NodePlan
from torchherd.recovery.failures import NodeRun, choose_first_failure


def node(host: str, state: str, failures: list[dict[str, object]] = (), error=None) -> NodeRun:  # type: ignore[assignment]
    plan = NodePlan(
        host=host,
        name=host,
        python="python3",
        nproc=1,
        local_addr=None,
        iface=None,
        is_host=False,
        argv=(),
        env={},
    )
    run = NodeRun(plan, state=state, failures=list(failures), error=error)
    run.ended_at = 1.0
    return run


def failure(
    rank: int,
    exitcode: int,
    *,
    signal: str | None = None,
    stderr: list[str] = (),  # type: ignore[assignment]
    timestamp: int = 100,
) -> dict[str, object]:
    return {
        "rank": rank,
        "exitcode": exitcode,
        "signal": signal,
        "message": "",
        "timestamp": timestamp,
        "last_stderr": list(stderr),
    }


def test_the_dead_rank_not_the_peer_that_lost_it() -> None:
    # Seen on the testbed: rank 2 exits with 3; a second later (same timestamp) rank 1 on the
    # other node fails with a Gloo read error, and node1 happens to be listed first.
    nodes = [
        node(
            "node1",
            "stopped",
            [
                failure(
                    1,
                    1,
                    stderr=["RuntimeError: [pair.cc:537] Read error: Connection reset by peer"],
                ),
                failure(0, -15, signal="SIGTERM"),
            ],
        ),
        node("node2", "failed", [failure(2, 3, stderr=["rank 2 failing on purpose"])]),
    ]
    chosen = choose_first_failure(nodes, trigger="node2")
    assert chosen is not None and (chosen.host, chosen.rank, chosen.exitcode) == ("node2", 2, 3)
    # Even if the peer's node reported first, the rank with its own error is the cause.
    chosen = choose_first_failure(nodes, trigger="node1")
    assert chosen is not None and chosen.rank == 2


def test_trigger_node_wins_among_own_failures_of_the_same_second() -> None:
    nodes = [
        node("node1", "stopped", [failure(0, 1, stderr=["ValueError: bad batch"])]),
        node("node2", "failed", [failure(1, 1, stderr=["ValueError: bad batch"])]),
    ]
    chosen = choose_first_failure(nodes, trigger="node2")
    assert chosen is not None and chosen.host == "node2"


def test_lost_node_beats_workers_killed_by_teardown() -> None:
    nodes = [
        node("node1", "stopped", [failure(0, -15, signal="SIGTERM", timestamp=90)]),
        node("node2", "lost", error={"message": "lost contact with node2", "remedy": "check it"}),
    ]
    chosen = choose_first_failure(nodes, trigger="node2")
    assert chosen is not None and chosen.host == "node2" and "lost contact" in chosen.message
    assert chosen.remedy == "check it"


def test_nothing_failed() -> None:
    assert choose_first_failure([node("node1", "succeeded")], trigger=None) is None


def attempt_of(tmp_path, hosts: list[str]):  # type: ignore[no-untyped-def]
    """An Attempt over a plan of ``hosts`` (nothing is started: only its judgement runs)."""
    from torchherd.launcher.attempt import Attempt
    from torchherd.logs import JobOutput
    from torchherd.plan import LaunchPlan
    from torchherd.spec import ClusterSpec, NodeSpec
    from torchherd.transport.local import LocalTransport

    cluster = ClusterSpec(nodes=tuple(NodeSpec(host=h) for h in hosts))
    plans = []
    for index, host in enumerate(hosts):
        plan = node(host, "running").plan
        plans.append(plan.__class__(**{**plan.__dict__, "local_addr": f"10.0.0.{index + 1}"}))
    launch_plan = LaunchPlan("job", "10.0.0.1:29500", len(hosts), tuple(plans), None, 1.0)
    output = JobOutput(tmp_path, hosts, len(hosts), stream=open(tmp_path / "out", "w"))  # noqa: SIM115
    return Attempt(launch_plan, cluster, LocalTransport(cluster), output, {}), output


def test_a_rendezvous_timeout_names_the_nodes_that_never_joined(tmp_path) -> None:  # type: ignore[no-untyped-def]
    attempt, output = attempt_of(tmp_path, ["n1", "n2", "n3"])
    attempt.state.ranks_seen.add(("n1", 0))
    timeout = {"error": "RendezvousTimeoutError", "message": "", "last_stderr": []}
    attempt.state.nodes["n1"].error = dict(timeout, message="rendezvous timed out")
    attempt.state.nodes["n1"].state = "failed"
    attempt.state.nodes["n2"].error = timeout
    attempt.state.nodes["n2"].state = "failed"
    attempt.state.trigger = "n1"
    failure = attempt.state.first_failure()
    output.close()
    assert failure is not None and failure.cause.endswith("never joined: n3"), failure


def test_a_reset_connection_points_at_the_peer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    attempt, output = attempt_of(tmp_path, ["n1", "n2"])
    reset = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:21345: "
    attempt.state.nodes["n1"].failures = [
        failure(0, 1, stderr=[reset + "Connection reset by peer"])
    ]
    attempt.state.nodes["n1"].state = "failed"
    attempt.state.trigger = "n1"
    found = attempt.state.first_failure()
    output.close()
    assert found is not None and found.cause.endswith("the peer is n2"), found


def test_a_worker_killed_from_outside_is_the_cause_not_its_peers_reset() -> None:
    """Seen on the testbed: node2's worker SIGKILLed (the OOM killer's way); node1's worker
    then fails with a reset connection. node2 was not being stopped by herd: its SIGKILL is
    the cause. The same signal on a node herd stopped is only the teardown."""
    reset = failure(
        0, 1, stderr=["RuntimeError: [pair.cc:537] Read error: Connection reset by peer"]
    )
    killed = failure(1, -9, signal="SIGKILL", timestamp=99)
    chosen = choose_first_failure(
        [node("node1", "stopped", [reset]), node("node2", "failed", [killed])], trigger="node2"
    )
    assert chosen is not None and (chosen.host, chosen.rank, chosen.signal) == (
        "node2",
        1,
        "SIGKILL",
    )
    torn_down = choose_first_failure(
        [node("node1", "failed", [reset]), node("node2", "stopped", [killed])], trigger="node1"
    )
    assert torn_down is not None and torn_down.host == "node1"
