"""The job loop (job.JobRun) driven with a fake attempt: what it does with each decision, its
record, its signals. The attempts, the replanning and the sweeps talk to nodes over ssh, which
cannot run in a unit test: FakeAttempt, fake_replan and fake sweeps stand in for them (named
so); the loop, the decision, the plans, the record and the output are the real ones."""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_plan import facts
from torchherd.errors import (
    EXIT_CRASH_LOOP,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_NEVER_EXITED,
    EXIT_OK,
    EXIT_SAVED,
)
from torchherd.launcher.attempt.state import LiveState
from torchherd.launcher.job import JobRun
from torchherd.launcher.outcome import AttemptResult
from torchherd.launcher.prepare import Prepared, refuse_public_rendezvous
from torchherd.plan import JobSpec, LaunchPlan, make_plan
from torchherd.records import job_dir
from torchherd.results import Failure
from torchherd.spec import ClusterSpec, NodeSpec
from torchherd.transport.local import LocalTransport

HOSTS = ("n1", "n2", "n3")


@dataclass
class Scripted:
    """How one fake attempt ends."""

    exit_code: int = EXIT_JOB_FAILED
    failed: str | None = "n2"
    lost: tuple[str, ...] = ()
    max_step: int | None = 10
    saves: int = 0
    during: Callable[[JobRun], None] | None = None
    """Called while the attempt runs (a signal arriving, say)."""
    lasts: float = 0.0
    """Seconds the attempt runs after ``during`` (what the job does meanwhile shows)."""


class FakeAttempt:
    """Stands in for attempt.Attempt (which starts torchrun on nodes over ssh): ends as
    scripted, with the outcome's shape the real one has; what the job reads of it while it
    runs is a real LiveState."""

    def __init__(self, job: JobRun, script: Scripted) -> None:
        self.job = job
        self.plan: LaunchPlan = job.prepared.plan
        self.number = job.number
        self.script = script
        self.state = LiveState(self.plan, self.number)
        self.state.saves = script.saves

    async def run(self) -> AttemptResult:
        await asyncio.sleep(0)
        if self.script.during is not None:
            self.script.during(self.job)
        await asyncio.sleep(self.script.lasts)
        hosts = [n.host for n in self.plan.nodes]
        s = self.script
        states = {
            h: "lost" if h in s.lost else "failed" if h == s.failed else "stopped" for h in hosts
        }
        if s.exit_code == EXIT_OK:
            states = {h: "succeeded" for h in hosts}
        failure = None
        if s.exit_code == EXIT_JOB_FAILED:
            where = s.lost[0] if s.lost else s.failed
            failure = Failure(where or "n1", 1, 1, None, "boom")
        return AttemptResult(
            job_id=self.plan.job_id,
            exit_code=s.exit_code,
            node_status=states,
            first_failure=failure,
            lost=tuple(h for h in hosts if h in s.lost),
            max_step=s.max_step,
            number=self.number,
            reusable=tuple(h for h in hosts if h not in s.lost),
        )

    def interrupt(self) -> None:
        self.state.interrupted = True

    def request_save(self, within: float, grow: str = "") -> None:
        self.state.growing = grow


def cluster() -> ClusterSpec:
    return ClusterSpec(nodes=tuple(NodeSpec(host=h, nproc=1) for h in HOSTS))


def all_facts() -> dict[str, Any]:
    return {
        h: facts(h, [("eth0", f"10.0.0.{i + 1}", 24)], ssh_addr=f"10.0.0.{i + 1}", port=29500)
        for i, h in enumerate(HOSTS)
    }


class Loop:
    """A JobRun over the three-node cluster, its attempts scripted."""

    def __init__(self, tmp_path: Path, scripts: list[Scripted], **job: Any) -> None:
        spec = JobSpec(entry=("train.py",), job_id="job-loop", **job)
        found = all_facts()
        plan = make_plan(cluster(), spec, found)
        self.scripts = list(scripts)
        self.attempts: list[FakeAttempt] = []
        self.replans: list[list[str]] = []
        self.swept: list[str] = []
        self.sweep_answers: dict[str, bool] = {}
        self.out = io.StringIO()
        self.run = JobRun(
            Prepared(cluster(), found, {}, plan),
            spec,
            LocalTransport(cluster()),
            stream=self.out,
            log_dir=tmp_path / "logs",
            color=False,
            attempts=self.attempt,
            replanner=self.fake_replan,
            sweeper=self.fake_sweep,
        )

    def attempt(self, job: JobRun) -> Any:
        made = FakeAttempt(job, self.scripts.pop(0))
        self.attempts.append(made)
        return made

    async def fake_replan(
        self, prepared: Prepared, job: JobSpec, transport: Any, *, nodes: list[str], links: Any
    ) -> Prepared:
        self.replans.append(list(nodes))
        plan = make_plan(prepared.cluster.select(nodes), job, prepared.facts)
        return Prepared(prepared.cluster, prepared.facts, prepared.secrets, plan)

    async def fake_sweep(self, last: LaunchPlan, node: Any) -> bool:
        self.swept.append(node.host)
        return self.sweep_answers.get(node.host, False)

    def go(self) -> Any:
        return asyncio.run(self.run.run())

    def record(self) -> dict[str, Any]:
        found = json.loads((job_dir("job-loop") / "job.json").read_text())
        assert isinstance(found, dict)
        return found


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))


def test_failures_restart_in_place_until_the_job_succeeds(tmp_path: Path) -> None:
    loop = Loop(tmp_path, [Scripted(), Scripted(max_step=20), Scripted(EXIT_OK)], max_restarts=3)
    result = loop.go()
    assert result.exit_code == EXIT_OK and result.restarts == 2
    assert [a.number for a in loop.attempts] == [0, 1, 2]
    assert not loop.replans and not loop.swept  # in place: no new plan, no sweep
    attempts = loop.record()["attempts"]
    assert [a.get("how") for a in attempts] == ["first", "in place", "in place"]
    assert [a["outcome"] for a in attempts] == ["failed", "failed", "succeeded"]
    assert "restarting the job (restart 2 of 3)" in loop.out.getvalue()


def test_a_crash_loop_ends_the_job_with_exit_4(tmp_path: Path) -> None:
    loop = Loop(tmp_path, [Scripted(max_step=5)] * 3, max_restarts=10, crash_loop=2)
    result = loop.go()
    assert result.exit_code == EXIT_CRASH_LOOP and len(loop.attempts) == 3
    assert "crash loop: 2 restart(s) in a row" in result.reason
    assert loop.record()["state"] == "failed" and loop.record()["exit_code"] == EXIT_CRASH_LOOP


def test_a_rank_that_never_exited_ends_the_job_as_finished_without_a_restart(
    tmp_path: Path,
) -> None:
    """The others finished and herd ended a rank that never exited: exit 6, recorded as such,
    and no restart though restarts are allowed (the job's work is done)."""
    loop = Loop(tmp_path, [Scripted(EXIT_NEVER_EXITED), Scripted(EXIT_OK)], max_restarts=3)
    result = loop.go()
    assert result.exit_code == EXIT_NEVER_EXITED and len(loop.attempts) == 1
    assert "restarting" not in loop.out.getvalue()
    assert re.search(
        r"job job-loop finished in [\d.]+ s, but a rank never exited", loop.out.getvalue()
    ), loop.out.getvalue()
    record = loop.record()
    assert record["state"] == "finished, a rank never exited" and record["exit_code"] == 6
    assert record["attempts"][0]["outcome"] == "finished, a rank never exited"


def test_an_attempt_that_ended_a_rank_that_never_exited_says_finished(tmp_path: Path) -> None:
    """The outcome of a real Attempt's ended state (no node) in which the others succeeded and
    herd stopped the rank that never exited: exit 6, the rank named, the summary's words."""
    import dataclasses

    from torchherd.launcher.attempt import Attempt
    from torchherd.launcher.outcome import result_of
    from torchherd.logs import JobOutput, render_summary

    loop = Loop(tmp_path, [])
    plan = loop.run.prepared.plan
    output = JobOutput(tmp_path / "logs2", list(HOSTS), plan.world_size, stream=io.StringIO())
    attempt = Attempt(plan, cluster(), LocalTransport(cluster()), output, {}, number=0)
    reason = "finished, but n2 rank 1 never exited (60 s after the first ranks finished)"
    state = dataclasses.replace(
        attempt.ended_state(),
        states={"n1": "succeeded", "n2": "stopped", "n3": "succeeded"},
        stopping=True,
        never_exited=True,
        hang_found=reason,
        behind=("n2 rank 1: still running at _shutdown (threading.py:1590)",),
        first_failure=Failure("", None, None, None, reason),
    )
    result = result_of(state, 70.0)
    output.close()
    assert result.exit_code == EXIT_NEVER_EXITED and result.hang is None
    assert result.first_failure is not None
    assert (result.first_failure.host, result.first_failure.rank) == ("n2", 1)
    summary = render_summary(result)
    assert summary.startswith(f"job {plan.job_id} finished in 70.0 s, but a rank never exited")
    assert "n2 rank 1: finished, but n2 rank 1 never exited" in summary


def test_the_budget_spent_ends_the_job_with_the_failure_and_says_so(tmp_path: Path) -> None:
    loop = Loop(tmp_path, [Scripted(max_step=s) for s in (1, 2, 3)], max_restarts=2)
    result = loop.go()
    assert result.exit_code == EXIT_JOB_FAILED and result.restarts == 2
    assert "gave up: the restart budget is spent (2 of 2)" in loop.out.getvalue()


def test_a_lost_node_with_min_nodes_gives_a_new_plan_without_it(tmp_path: Path) -> None:
    loop = Loop(tmp_path, [Scripted(lost=("n1",)), Scripted(EXIT_OK)], max_restarts=1, min_nodes=2)
    result = loop.go()
    assert result.exit_code == EXIT_OK
    assert loop.replans == [["n2", "n3"]]
    assert [n.host for n in loop.attempts[1].plan.nodes] == ["n2", "n3"]
    assert loop.attempts[1].plan.world_size == 2
    assert "n1" in loop.run.pool.left_out  # looked at again, to grow back
    entry = loop.record()["attempts"][1]
    assert entry["how"] == "new plan" and "going on without n1" in entry["why"]


def n1_back(job: JobRun) -> None:
    """n1, left out, answers again: where pool.bring_back leaves it once its sweep, probe and
    checks (over ssh) have passed."""
    del job.pool.left_out["n1"]
    job.pool.returned.append("n1")


@pytest.mark.parametrize(("saves", "growing"), [(0, ""), (1, "n1 back: growing the job")])
def test_a_node_back_grows_a_job_at_its_snapshot_or_else_at_its_next_restart(
    tmp_path: Path, saves: int, growing: str
) -> None:
    """A job that reported a snapshot is asked to save and stop for a node back; one that
    never did is left to run (stopping it would lose its work) and grows at its next restart."""
    scripts = [
        Scripted(lost=("n1",)),
        Scripted(saves=saves, during=n1_back, lasts=1.5),
        Scripted(EXIT_OK),
    ]
    loop = Loop(tmp_path, scripts, max_restarts=2, min_nodes=2)
    assert loop.go().exit_code == EXIT_OK
    assert loop.attempts[1].state.growing == growing
    assert loop.replans == [["n2", "n3"], ["n1", "n2", "n3"]]
    assert loop.attempts[2].plan.world_size == 3


def test_a_new_rendezvous_host_with_a_public_address_ends_the_job_saying_why(
    tmp_path: Path,
) -> None:
    """--min-nodes moves the rendezvous to n2, which has a public address: the restart's plan
    is refused (the real check, on n2's facts; the probe over ssh is the fake part) and the
    job ends with the refusal and its fix, starting nothing more."""
    loop = Loop(tmp_path, [Scripted(lost=("n1",))], max_restarts=1, min_nodes=2)
    nics = [("eth0", "10.0.0.2", 24), ("eth1", "8.8.4.4", 24)]
    loop.run.pool.facts["n2"] = facts("n2", nics, ssh_addr="10.0.0.2", port=29500)

    async def replan_checked(prepared: Prepared, job: JobSpec, *args: Any, **kw: Any) -> Prepared:
        fresh = await loop.fake_replan(prepared, job, *args, **kw)
        refuse_public_rendezvous(prepared.cluster.select(kw["nodes"]), prepared.facts, fresh.plan)
        return fresh

    loop.run.replan = replan_checked
    result = loop.go()
    assert result.exit_code == EXIT_JOB_FAILED and len(loop.attempts) == 1
    out = loop.out.getvalue()
    refused = "herd: cannot restart: n2: the rendezvous store would listen on public address(es)"
    assert f"{refused} 8.8.4.4" in out and "allow_public_rendezvous = true" in out, out


def test_a_lost_node_the_job_needs_is_swept_and_waited_for(tmp_path: Path) -> None:
    loop = Loop(tmp_path, [Scripted(lost=("n1",)), Scripted(EXIT_OK)], max_restarts=1)
    loop.sweep_answers["n1"] = True
    assert loop.go().exit_code == EXIT_OK
    assert loop.swept == ["n1"] and loop.replans == [["n1", "n2", "n3"]]


def test_a_lost_node_that_never_answers_ends_the_job_with_what_to_do(tmp_path: Path) -> None:
    loop = Loop(tmp_path, [Scripted(lost=("n1",))], max_restarts=1)
    result = loop.go()
    assert result.exit_code == EXIT_JOB_FAILED and loop.swept == ["n1"]
    out = loop.out.getvalue()
    assert "cannot restart: n1 still do(es) not answer: 2 node(s) left, 3 needed" in out
    assert "--min-nodes M" in out and len(loop.attempts) == 1


def test_a_time_limit_while_replanning_exits_5_with_a_snapshot(tmp_path: Path) -> None:
    """SIGUSR1 between attempts: no attempt starts, and the job's committed snapshot stands
    (exit 5, requeue me)."""
    loop = Loop(
        tmp_path, [Scripted(lost=("n1",), saves=2), Scripted(EXIT_OK)], max_restarts=1, min_nodes=2
    )
    real = loop.fake_replan

    async def replan_then_limit(*args: Any, **kw: Any) -> Prepared:
        loop.run.save_and_stop()
        await asyncio.sleep(5)  # cancelled by the signal
        return await real(*args, **kw)

    loop.run.replan = replan_then_limit
    result = loop.go()
    assert result.exit_code == EXIT_SAVED and len(loop.attempts) == 1
    assert "the time limit came while the job was restarting" in loop.out.getvalue()
    assert loop.record()["state"] == "saved"


def test_a_time_limit_as_an_attempt_ends_starts_nothing_more(tmp_path: Path) -> None:
    """The limit comes as the failed attempt ends (nothing could save any more): without any
    committed snapshot, the failure stands and nothing more starts."""

    def limit(job: JobRun) -> None:
        job.current = None  # the attempt is over, as far as the signal can tell
        job.save_and_stop()

    loop = Loop(tmp_path, [Scripted(during=limit), Scripted(EXIT_OK)], max_restarts=3)
    result = loop.go()
    assert result.exit_code == EXIT_JOB_FAILED and len(loop.attempts) == 1
    assert "never reported a committed snapshot" in result.reason


def test_ctrl_c_between_attempts_is_acted_on_before_the_next_starts(tmp_path: Path) -> None:
    loop = Loop(tmp_path, [Scripted(lost=("n1",)), Scripted(EXIT_OK)], max_restarts=1)

    async def answer_then_interrupt(last: LaunchPlan, node: Any) -> bool:
        loop.run.interrupt()
        return True

    loop.run.sweep = answer_then_interrupt
    result = loop.go()
    assert result.exit_code == EXIT_INTERRUPTED and len(loop.attempts) == 1
    assert loop.record()["state"] == "stopped"


def test_survivors_of_a_kill_keep_their_node_out_of_an_in_place_restart(tmp_path: Path) -> None:
    """An agent's exit event names processes that outlived its kill: the node is not reusable
    in place (the next attempt would start beside them) and its end is unconfirmed, so the
    decision sweeps it first; herd says so. A real Attempt fed the agent's event (no node)."""
    from torchherd.launcher.attempt import Attempt
    from torchherd.logs import JobOutput
    from torchherd.recovery.policy import Action, Bench, Ended, History, RestartPolicy

    loop = Loop(tmp_path, [])
    plan = loop.run.prepared.plan
    out = io.StringIO()
    output = JobOutput(tmp_path / "logs2", list(HOSTS), plan.world_size, stream=out, color=False)

    async def ended() -> Any:
        attempt = Attempt(plan, cluster(), LocalTransport(cluster()), output, {}, number=0)
        for host, node in attempt.state.nodes.items():
            event = {"e": "exit", "code": 1 if host == "n2" else -15, "stopped": host != "n2"}
            if host == "n3":
                event["survivors"] = [4242]
            attempt.events.exited(node, event)
        return attempt.ended_state()

    state = asyncio.run(ended())
    output.close()
    assert "n3" not in state.reusable and "n3" in state.unconfirmed
    assert "outlived the kill on n3 (pid 4242): n3 takes no further attempt" in out.getvalue()
    decision = RestartPolicy(max_restarts=1).decide(
        Ended(1, HOSTS, lost=frozenset(state.unconfirmed), reusable=frozenset(state.reusable)),
        Bench(order=HOSTS, size=3, nproc={h: 1 for h in HOSTS}),
        History(),
    )
    assert decision.action is Action.SWEEP and decision.sweep == ("n3",)


def test_each_attempt_keeps_its_own_step_times_and_where_a_node_was_named_slow(
    tmp_path: Path,
) -> None:
    """Beats reports fed to each attempt's real LiveState; a slow rank named in the first:
    at once its entry holds the step times so far and the mark, and each attempt's entry ends
    with its own nodes' step times (not the job's list of nodes, not the other attempt's)."""
    from torchherd.recovery.straggler import Slow

    seen_at_naming: list[dict[str, Any]] = []

    def beats(work: float) -> Callable[[JobRun], None]:
        def during(job: JobRun) -> None:
            assert job.current is not None
            for i in range(3):
                for host in HOSTS:
                    slow = 1.3 if host == "n2" and work > 0.1 else 1.0
                    beat = [0, 10 * i, 100.0 + i, None, 0.01, 0.01 + work * slow, 0.0]
                    job.current.state.reported(host, [beat], float(i), 1000.0 + i)
            if work > 0.1:
                job._slow(Slow("n2", 1, "is 1.30x slower than the median rank", 1.3))
                seen_at_naming.append(json.loads(json.dumps(job.record.attempts[-1])))

        return during

    loop = Loop(
        tmp_path,
        [Scripted(during=beats(0.2)), Scripted(EXIT_OK, during=beats(0.1))],
        max_restarts=1,
    )
    assert loop.go().exit_code == EXIT_OK
    [named] = seen_at_naming
    n2 = next(n for n in named["nodes"] if n["host"] == "n2")
    assert n2["named_slow_at"] > 0 and [p[1] for p in n2["step_times"]] == [0.26] * 3
    first, second = loop.record()["attempts"]
    works = {
        (a["n"], n["host"]): {p[1] for p in n["step_times"]}
        for a in (first, second)
        for n in a["nodes"]
    }
    assert works == {
        (0, "n1"): {0.2}, (0, "n2"): {0.26}, (0, "n3"): {0.2},
        (1, "n1"): {0.1}, (1, "n2"): {0.1}, (1, "n3"): {0.1},
    }  # fmt: skip
    assert ["named_slow_at" in n for n in second["nodes"]] == [False] * 3
    assert all("step_times" not in n for n in loop.record()["nodes"])
