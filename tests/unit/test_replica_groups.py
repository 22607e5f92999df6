"""Replica groups' pure parts: the variables a group gets, the lighthouse's job, the torchft
check before a launch, and how a training script reads herd's variables."""

from __future__ import annotations

import pytest

from torchherd.errors import NodeNotReady
from torchherd.facts import NodeFacts
from torchherd.launcher.groups import HEARTBEAT_MS, check_torchft, group_env, lighthouse_job
from torchherd.plan import JobSpec


def test_a_group_gets_the_lighthouse_its_number_and_its_routable_address() -> None:
    job = JobSpec(entry=("train.py",), env={"TORCHFT_QUORUM_RETRIES": "7"})
    env = group_env(job, 2, 3, "http://10.0.0.1:29500", "10.0.0.3")
    assert env["TORCHFT_LIGHTHOUSE"] == "http://10.0.0.1:29500"
    assert (env["HERD_REPLICA_GROUP"], env["HERD_REPLICA_GROUPS"]) == ("2", "3")
    assert (env["REPLICA_GROUP_ID"], env["NUM_REPLICA_GROUPS"]) == ("2", "3")
    assert env["HERD_GROUP_ADDR"] == "10.0.0.3"
    assert env["TORCHFT_QUORUM_RETRIES"] == "7"  # --env wins over herd's default
    assert "HERD_GROUP_ADDR" not in group_env(JobSpec(entry=("t.py",)), 0, 1, "http://a:1", None)


def test_the_lighthouse_is_a_module_job_of_its_own_that_restarts_without_end() -> None:
    job = JobSpec(entry=("train.py", "--x"), max_restarts=2, job_id="0101-000000-abcd")
    light = lighthouse_job(job, 29555, "[::]")
    assert light.module and light.nproc == 1 and light.kind == "lighthouse"
    assert light.entry[0] == "torchherd.train.lighthouse"
    assert "--bind=[::]:29555" in light.entry
    assert f"--heartbeat_timeout_ms={HEARTBEAT_MS}" in light.entry
    assert light.job_id == "0101-000000-abcd-lighthouse"
    assert light.max_restarts >= 100 and light.crash_loop >= 100


def test_nodes_without_torchft_are_named_with_how_to_install_it() -> None:
    facts = {
        "a": NodeFacts.from_probe("a", {"torchft_version": "0.2.0"}),
        "b": NodeFacts.from_probe("b", {"torchft_version": None}),
    }
    check_torchft(facts, ["a"])
    with pytest.raises(NodeNotReady) as raised:
        check_torchft(facts, ["a", "b"])
    assert "not installed on b" in raised.value.message
    assert "torchherd[ft]" in raised.value.remedy
    assert raised.value.hosts == ("b",)


def test_a_script_reads_its_group_from_herds_variables() -> None:
    pytest.importorskip("torch")
    from torchherd.train.replica_groups import group_env as read

    assert read({}) is None
    where = read(
        {
            "HERD_REPLICA_GROUPS": "3",
            "HERD_REPLICA_GROUP": "1",
            "TORCHFT_LIGHTHOUSE": "http://h:1",
            "HERD_GROUP_ADDR": "10.0.0.2",
        }
    )
    assert where is not None
    assert (where.group, where.groups, where.addr) == (1, 3, "10.0.0.2")


def test_a_plan_that_drew_a_store_port_already_given_is_made_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lighthouse and group 0 are planned at once on the first node, each probe picking
    a port free there at that moment: a plan whose store address another of the job's plans
    was given (the lighthouse's own first) is made again, and the one set aside closes its
    links. Plans stand in for replan here: which port a probe draws is chance on real nodes."""
    import asyncio
    from types import SimpleNamespace

    from torchherd.launcher import groups

    drawn = iter(["10.0.0.1:29500", "10.0.0.1:29600", "10.0.0.1:29700"])
    closed: list[str] = []

    async def replan(*_args: object, **_kwargs: object) -> SimpleNamespace:
        endpoint = next(drawn)
        plan = SimpleNamespace(rdzv_endpoint=endpoint)
        return SimpleNamespace(plan=plan, links={"node1": endpoint})

    async def close_links(links: dict[str, str]) -> None:
        closed.append(links["node1"])

    monkeypatch.setattr(groups, "replan", replan)
    monkeypatch.setattr(groups, "close_links", close_links)
    run = object.__new__(groups.GroupsRun)
    run.prepared, run.transport = None, None  # type: ignore[assignment]
    run.endpoints = {"10.0.0.1:29500", "10.0.0.1:29600"}  # the lighthouse's, a group's
    job = JobSpec(entry=("t.py",))
    prepared = asyncio.run(run._plan_apart(job, ["node1"]))
    assert prepared.plan.rdzv_endpoint == "10.0.0.1:29700"
    assert closed == ["10.0.0.1:29500", "10.0.0.1:29600"]
    assert "10.0.0.1:29700" in run.endpoints


def test_a_restart_of_a_run_also_draws_a_store_port_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's run restarting in place (its JobRun's replanner) is planned apart from the
    lighthouse's and the other groups' stores as its first plan was; a plan set aside closes
    the links it opened, never the live links the restart was given."""
    import asyncio
    from types import SimpleNamespace

    from torchherd.launcher import groups

    drawn = iter(["10.0.0.1:29500", "10.0.0.1:29800"])
    live, opened = object(), object()
    closed: list[dict[str, object]] = []

    async def replan(*_args: object, **kwargs: object) -> SimpleNamespace:
        given = dict(kwargs["links"])  # type: ignore[call-overload]
        plan = SimpleNamespace(rdzv_endpoint=next(drawn))
        return SimpleNamespace(plan=plan, links={**given, "node2": opened})

    async def close_links(links: dict[str, object]) -> None:
        closed.append(links)

    monkeypatch.setattr(groups, "replan", replan)
    monkeypatch.setattr(groups, "close_links", close_links)
    run = object.__new__(groups.GroupsRun)
    run.endpoints = {"10.0.0.1:29500"}  # the lighthouse's
    job = JobSpec(entry=("t.py",))
    fresh = asyncio.run(
        run._replan_apart(None, job, None, nodes=["node1", "node2"], links={"node1": live})  # type: ignore[arg-type]
    )
    assert fresh.plan.rdzv_endpoint == "10.0.0.1:29800"
    assert closed == [{"node2": opened}]  # the live link of node1 stays open
    assert "10.0.0.1:29800" in run.endpoints
