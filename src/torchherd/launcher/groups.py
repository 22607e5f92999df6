"""A job run as replica groups (``herd launch --replica-groups``): a lost node costs one group,
not the job.

    lighthouse   torchft's coordinator, a one-worker herd job of its own on the first node,
                 restarted in place whenever it dies (the groups' quorum retries wait for it)
    group i      node i alone, or ``--group-nodes K`` nodes in plan order (nodes iK..iK+K-1):
                 its own torchrun, its own store (a rendezvous of its nodes), its own
                 restarts; when it dies only it restarts, on the same nodes once they answer
                 again, or with a free spare in a lost node's place; the other groups go on
                 stepping without it (torchft)
    the job      over when every group is over: succeeded when every group that ran to the end
                 succeeded; a group whose node never came back is reported, not waited for

Each group and the lighthouse are ``JobRun``s (job.py) with their own record and logs under the
job's directory (``group-<i>/``, ``lighthouse/``), so everything a job does for a failure
(stacks, sweeps, no overlapping attempts, teardown) a group does too. This module only starts
them, sets what torchft needs (the lighthouse's address, quorum retries, the address each group
is reached at, the interface for Gloo's weight copies, which the plan already picks), and
watches the groups' steps to tell each outage in the console and the job record: when the
group went down, how long until the others committed their next step, how long until it was
back in step with them (healed). It also judges slow ranks across the groups: a group's own
watch sees only its ranks, but every group waits for the slowest rank of any group in the
all-reduce over the groups, so every rank's step timing also goes to one judge here
(recovery.straggler), which names the rank the others wait for.

The launcher never imports torch or torchft; the lighthouse runs on the node as
``python -m torchherd.train.lighthouse``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from ..errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, NodeNotReady
from ..facts import NodeFacts
from ..job_nodes import new_record
from ..plan import JobSpec, LaunchPlan, NodePlan, check_group_split, make_plan
from ..records import job_dir
from ..recovery import RestartPolicy
from ..recovery.straggler import CHECK_EVERY, StragglerWatch
from ..results import RunResult
from ..transport import Transport
from .job import JobRun, finish_record
from .links import AgentLink
from .prepare import Prepared, close_links, replan
from .sweeps import sweep_attempt

# The lighthouse drops a group it has not heard from for this long; the others then commit
# their next step without it. torchft's default is 5 s; 3 s keeps a loaded node's late
# heartbeat (every 100 ms) well inside it.
HEARTBEAT_MS = 3000
# Seconds a group waits for the lighthouse: at its start (it may start first) and per quorum
# retry while herd restarts a lighthouse that died (torchft's default, 0 retries, ends every
# group within a moment of the lighthouse).
CONNECT_TIMEOUT_S = 120
QUORUM_RETRIES = 100
COLLECTIVE_TIMEOUT_S = 3
# A dead lighthouse is restarted this many times; it reports no steps, so herd's crash-loop
# rule (restarts without progress) must not end it.
LIGHTHOUSE_RESTARTS = 1000
# Plans of a group (or of the lighthouse) tried before it keeps a port another of this job's
# stores was given (two probes picked the same free port; see _plan_apart).
PLAN_TRIES = 3
# Seconds between looks at a lost group's node, and at the groups' steps.
NODE_RETRY_EVERY = 5.0
WATCH_EVERY = 0.25


@dataclass
class Outage:
    """One time a group went down, as herd saw it."""

    group: int
    host: str
    down_at: float
    """time.monotonic() when herd last saw the group running (its durations' origin)."""
    steps_before: int
    """The highest step the live groups had reached when it went down."""
    next_commit_s: float | None = None
    """Seconds until another group committed a step past ``steps_before``."""
    healed_s: float | None = None
    """Seconds until the group stepped again, level with the others."""
    down_wall: float = field(init=False)
    """The same moment on the wall clock, as the job record keeps its times."""

    def __post_init__(self) -> None:
        self.down_wall = time.time() - (time.monotonic() - self.down_at)

    def entry(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "host": self.host,
            "down_at": round(self.down_wall, 3),
            "steps_before": self.steps_before,
            "next_commit_s": self.next_commit_s,
            "healed_s": self.healed_s,
        }


@dataclass
class Group:
    index: int
    nodes: list[str]
    """The nodes it runs on now (its rank 0 on the first), in the order of the launch's plan."""
    run: JobRun | None = None
    runs: int = 0
    result: RunResult | None = None
    seen_attempt: object = None
    """The attempt herd last saw running (None: none since the last outage)."""
    alive_at: float = 0.0
    others_then: int = 0
    """The other groups' highest step when this group was last seen running."""
    outages: list[Outage] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    """Every node (set of nodes: ``host``) the group ran on, in order (a spare took a lost
    node's place)."""
    waiting_for: str | None = None
    """Why its node cannot run it now, as last said (said again only when it changes)."""
    seen_on: str = ""
    """The node(s) of the attempt herd last saw running."""
    node_lost: str | None = None
    """Its run found this node of it lost and a spare free: the next run goes to the spare."""

    def __post_init__(self) -> None:
        self.hosts = self.hosts or [self.host]

    @property
    def host(self) -> str:
        """Its node, or its nodes joined by commas: how the console and the record name it."""
        return ",".join(self.nodes)

    def step(self) -> int | None:
        """The highest step this group's current attempt reported (None: not stepping)."""
        attempt = self.run.current if self.run is not None else None
        return attempt.hang.max_step if attempt is not None else None


def group_env(job: JobSpec, index: int, groups: int, lighthouse: str, addr: str | None) -> dict:
    """The variables a group's workers get (train/replica_groups.py reads them)."""
    env = {
        "TORCHFT_LIGHTHOUSE": lighthouse,
        "TORCHFT_QUORUM_RETRIES": str(QUORUM_RETRIES),
        "TORCHFT_CONNECT_TIMEOUT_SEC": str(CONNECT_TIMEOUT_S),
        "HERD_REPLICA_GROUP": str(index),
        "HERD_REPLICA_GROUPS": str(groups),
        "REPLICA_GROUP_ID": str(index),
        "NUM_REPLICA_GROUPS": str(groups),
        # torchft's Rust side logs every quorum and commit at INFO (about 1.4 KB per step per
        # group); warnings and errors still come.
        "RUST_LOG": "warn",
        # Seconds a collective waits: after a loss the next quorum may still hold the dead
        # group (until the lighthouse's heartbeat timeout), and setting up its process group
        # waits this long for it. torchft's 60 s would stall the survivors that long. The
        # weights a rejoining group copies keep the Trainer's own, longer limit.
        "TORCHFT_TIMEOUT_SEC": str(COLLECTIVE_TIMEOUT_S),
    }
    if addr:
        env["HERD_GROUP_ADDR"] = addr
    env.update(job.env)  # --env wins
    return env


def lighthouse_job(job: JobSpec, port: int, bind: str = "0.0.0.0") -> JobSpec:
    return replace(
        job,
        entry=(
            "torchherd.train.lighthouse",
            "--min_replicas=1",
            f"--bind={bind}:{port}",
            f"--heartbeat_timeout_ms={HEARTBEAT_MS}",
        ),
        module=True,
        no_python=False,
        nproc=1,
        job_id=f"{job.job_id}-lighthouse",
        max_restarts=LIGHTHOUSE_RESTARTS,
        crash_loop=LIGHTHOUSE_RESTARTS,
        kind="lighthouse",
    )


def split_into_groups(hosts: list[str], size: int) -> list[Group]:
    """The plan's nodes in groups of ``size`` (--group-nodes), in plan order: the first group
    holds the first node (where the lighthouse runs)."""
    check_group_split(len(hosts), size)
    return [Group(i, hosts[i * size : (i + 1) * size]) for i in range(len(hosts) // size)]


def check_torchft(facts: Mapping[str, NodeFacts], hosts: list[str]) -> None:
    """Every node of a replica-group job must have torchft (the probe reads its version from
    the installed metadata): said before anything starts, with how to install it."""
    missing = [h for h in hosts if not facts[h].extra.get("torchft_version")]
    if missing:
        raise NodeNotReady(
            f"--replica-groups needs torchft, which is not installed on {', '.join(missing)}",
            "pip install 'torchherd[ft]' on every node (herd exec -- pip install "
            "'torchherd[ft]'), or launch without --replica-groups",
            hosts=tuple(missing),
        )


class GroupsRun:
    """Runs a prepared job as replica groups to its end (see the module's docstring)."""

    def __init__(
        self,
        prepared: Prepared,
        job: JobSpec,
        transport: Transport,
        *,
        stream: TextIO,
        log_dir: Any = None,
        color: bool | None = None,
        hang_timeout: float | None = None,
    ) -> None:
        self.prepared = prepared
        self.job = job
        self.transport = transport
        self.stream = stream
        self.color = color
        self.hang_timeout = hang_timeout
        self.log_dir = log_dir or job_dir(job.job_id)
        self.groups = split_into_groups([n.host for n in prepared.plan.nodes], job.group_nodes)
        self.lighthouse: JobRun | None = None
        self.interrupted = False
        self.all_down_said = False
        self.lost_nodes: set[str] = set()
        """Nodes a group left for a spare: never offered as a spare again in this job."""
        self.fences: list[asyncio.Task[None]] = []
        """Sweeps of lost nodes, each waiting for its node to answer again."""
        self.endpoints: set[str] = (
            {prepared.plan.rdzv_endpoint} if prepared.plan.rdzv_endpoint else set()
        )
        """Every store address (host:port) this job's plans were given, the lighthouse's own
        first: a new plan takes none of them (_plan_apart)."""
        self.slow = StragglerWatch()
        """Every group's ranks' step timings: who the groups wait for."""
        self.record = new_record(prepared.cluster, prepared.plan, self.log_dir, state="running")
        self.record.kind = job.kind

    def note(self, text: str) -> None:
        self.stream.write(f"herd: {text}\n")
        self.stream.flush()

    def interrupt(self) -> None:
        self.interrupted = True
        for run in [self.lighthouse, *(g.run for g in self.groups)]:
            if run is not None:
                run.interrupt()

    def save_and_stop(self) -> None:
        for group in self.groups:
            if group.run is not None:
                group.run.save_and_stop()

    async def run(self) -> RunResult:
        spares = [n.host for n in self.prepared.cluster.spares if n.host in self.prepared.facts]
        check_torchft(self.prepared.facts, [n.host for n in self.prepared.plan.nodes] + spares)
        started = time.monotonic()
        plan = self.prepared.plan
        first = plan.nodes[0]
        # The port the probe found free on the first node, which the job's own store would
        # have used: each group plans a store of its own.
        port = int((plan.rdzv_endpoint or ":29510").rsplit(":", 1)[1])
        addr = first.local_addr or "127.0.0.1"
        lighthouse = f"http://[{addr}]:{port}" if ":" in addr else f"http://{addr}:{port}"
        self.note(
            f"job {plan.job_id}: {len(self.groups)} replica group(s) "
            f"[{', '.join(g.host for g in self.groups)}], lighthouse on {first.host} at "
            f"{lighthouse}"
        )
        self.record.save()
        # The links prepare() opened were warmed for the job's own id; each group and the
        # lighthouse opens its own (one attempt at a time per link).
        await close_links(self.prepared.links)
        keeper = asyncio.create_task(
            self._keep_lighthouse(port, "[::]" if ":" in addr else "0.0.0.0")
        )
        watcher = asyncio.create_task(self._watch())
        judge = asyncio.create_task(self._judge_slow())
        try:
            await asyncio.gather(*(self._keep_group(g, lighthouse) for g in self.groups))
        finally:
            watcher.cancel()
            judge.cancel()
            if self.lighthouse is not None:
                self.lighthouse.interrupt()
            else:
                keeper.cancel()  # still planning it
            await asyncio.gather(keeper, return_exceptions=True)
            # A lost node still silent at the end: its leftover worker finds no lighthouse
            # to rejoin, and its agent ends it when it finds the launcher gone.
            for fence in self.fences:
                fence.cancel()
            await asyncio.gather(*self.fences, return_exceptions=True)
        result = self._result(time.monotonic() - started)
        self._write_record(result)
        return result

    async def _keep_lighthouse(self, port: int, bind: str) -> None:
        job = lighthouse_job(self.job, port, bind)
        first = self.prepared.plan.nodes[0].host
        prepared = await self._plan_apart(job, [first])
        self.lighthouse = JobRun(
            prepared,
            job,
            self.transport,
            stream=self.stream,
            log_dir=self.log_dir / "lighthouse",
            color=self.color,
            hang_timeout=0,
            replanner=self._replan_apart,
            # Its log (a few lines per quorum, every step) stays in lighthouse/; the console
            # keeps its agent's lines and herd's word when it dies.
            ranks=frozenset(),
            policy=RestartPolicy(
                max_restarts=LIGHTHOUSE_RESTARTS, min_nodes=1, crash_loop=LIGHTHOUSE_RESTARTS
            ),
        )
        if self.interrupted:
            self.lighthouse.interrupt()
        await self.lighthouse.run()

    async def _keep_group(self, group: Group, lighthouse: str) -> None:
        """Run one group until it succeeds, the job is stopped, or its restarts are spent;
        after a loss, start it again on its node once the node answers."""
        budget = max(1, self.job.max_restarts + 1)
        while not self.interrupted and group.runs < budget:
            try:
                prepared, job = await self._group_plan(group, lighthouse)
            except NodeNotReady as exc:  # its probe failed: unreachable (usually), or broken
                if self._others_done(group):
                    return  # the others finished: nothing to rejoin
                lost = next((h for h in exc.hosts if h in group.nodes), group.nodes[0])
                if not self._to_spare(group, lost):
                    why = " ".join(exc.message.split())
                    if why != group.waiting_for:
                        group.waiting_for = why
                        self.note(
                            f"group {group.index} waits for {lost} (looked at every "
                            f"{NODE_RETRY_EVERY:g} s): {why}"
                        )
                    await asyncio.sleep(NODE_RETRY_EVERY)
                continue
            group.waiting_for = None
            group.runs += 1
            group.result = None
            group.node_lost = None
            group.run = JobRun(
                prepared,
                job,
                self.transport,
                stream=self.stream,
                log_dir=self.log_dir / f"group-{group.index}",
                color=self.color,
                hang_timeout=self.hang_timeout,
                sweeper=functools.partial(self._sweep_lost, group),
                on_timing=self.slow.timed,
                replanner=self._replan_apart,
            )
            if self.interrupted:
                group.run.interrupt()
            group.result = await group.run.run()
            if group.result.exit_code == 0 or self.interrupted:
                return
            self.note(f"group {group.index} on {group.host} ended: {group.result.reason}")
            if group.node_lost:
                self._to_spare(group, group.node_lost)

    def _group_job(self, group: Group, lighthouse: str, addr: str | None = None) -> JobSpec:
        """The group's own job. Its variables travel in the job's env, so that every plan
        of it (a restart in place is planned again) carries them."""
        env = group_env(self.job, group.index, len(self.groups), lighthouse, addr)
        return replace(
            self.job,
            job_id=f"{self.job.job_id}-g{group.index}",
            kind="replica-group",
            attempt=group.runs,
            # A group runs on all of its nodes or not at all (a lost one: a spare or a wait).
            min_nodes=len(group.nodes),
            env=env,
        )

    async def _group_plan(self, group: Group, lighthouse: str) -> tuple[Prepared, JobSpec]:
        job = self._group_job(group, lighthouse, self._address(group.nodes[0]))
        return await self._plan_apart(job, group.nodes), job

    async def _plan_apart(self, job: JobSpec, nodes: list[str]) -> Prepared:
        """The plan of a group's (or the lighthouse's) run on ``nodes``, its store on a port
        none of this job's other plans was given (_replan_apart)."""
        return await self._replan_apart(self.prepared, job, self.transport, nodes=nodes)

    async def _replan_apart(
        self,
        prepared: Prepared,
        job: JobSpec,
        transport: Transport,
        *,
        nodes: list[str],
        links: Mapping[str, AgentLink] | None = None,
    ) -> Prepared:
        """prepare.replan, its store on a port none of this job's other plans was given: the
        first plan of every run and each run's restarts (its JobRun's replanner). The
        lighthouse and group 0 share the first node and are planned at the same moment: each
        probe picks a port free there then, and nothing holds it until its torchrun binds it,
        so both could pick the same one and the second to bind fail (seen: one pick in about
        600); a group restarting beside the running lighthouse could draw its port too. A plan
        set aside closes the links it opened, never the ones it was given."""
        given = dict(links or {})
        for tries_left in reversed(range(PLAN_TRIES)):
            fresh = await replan(prepared, job, transport, nodes=nodes, links=given)
            endpoint = fresh.plan.rdzv_endpoint
            if endpoint is None or endpoint not in self.endpoints or not tries_left:
                break
            opened = {h: link for h, link in fresh.links.items() if given.get(h) is not link}
            await close_links(opened)
        if endpoint is not None:
            self.endpoints.add(endpoint)
        return fresh

    def _address(self, host: str) -> str | None:
        """The address the launch's plan found for a node (a group's first node, where its
        rank 0 runs, advertises it to the other groups); a spare's is planned as the launch's
        would have been (its route to the first node)."""
        for planned in self.prepared.plan.nodes:
            if planned.host == host:
                return planned.local_addr
        first = self.prepared.plan.nodes[0].host
        both = self.prepared.cluster.select([first, host])
        plan = make_plan(both, self.job, self.prepared.facts, self.prepared.secrets)
        return next(n.local_addr for n in plan.nodes if n.host == host)

    async def _sweep_lost(self, group: Group, last: LaunchPlan, node: NodePlan) -> bool:
        """The group's run asks whether its lost node can be swept before a restart there.
        With a spare free, the answer is no at once: the group moves to the spare instead of
        waiting on the node (its leftovers are swept once it answers again, ``_to_spare``)."""
        if self._free_spares():
            group.node_lost = node.host
            return False
        assert group.run is not None
        return await group.run.sweep_lost_node(last, node)

    def _free_spares(self) -> list[str]:
        taken = {h for g in self.groups for h in g.nodes} | {self.prepared.plan.nodes[0].host}
        return [
            n.host
            for n in self.prepared.cluster.spares
            if n.host not in taken and n.host in self.prepared.facts
            and n.host not in self.lost_nodes
        ]  # fmt: skip

    def _to_spare(self, group: Group, lost: str) -> bool:
        """A group whose node ``lost`` does not answer moves to a free spare at once (its data
        shard and number stay; it heals from the live groups like a group restarted in
        place). False: no spare is free, the group waits for its node."""
        free = self._free_spares()
        if not free:
            return False
        group.nodes[group.nodes.index(lost)] = free[0]
        group.hosts.append(group.host)
        self.lost_nodes.add(lost)
        if group.run is not None:
            # Its worker there may still run, cut off: once the node answers, it is ended, so
            # that it never rejoins the quorum beside the group's new worker.
            fence = self._sweep_when_back(group.index, group.run.prepared.plan, lost)
            self.fences.append(asyncio.create_task(fence))
        self.note(f"group {group.index}: {lost} does not answer; spare {free[0]} takes its place")
        self._write_record(None)
        return True

    async def _sweep_when_back(self, index: int, plan: LaunchPlan, lost: str) -> None:
        """End the group's last attempt (``plan``) on its lost node once it answers."""
        last = next(n for n in plan.nodes if n.host == lost)
        while True:
            swept = await sweep_attempt(
                self.transport, self.prepared.cluster, plan.job_id, last, grace=plan.grace
            )
            if swept.confirmed:
                if swept.processes:
                    self.note(
                        f"group {index}: ended what it left on {last.host} when the node was "
                        f"lost ({swept.processes} process(es))"
                    )
                return
            await asyncio.sleep(NODE_RETRY_EVERY)

    def _others_done(self, group: Group) -> bool:
        return all(g.result is not None for g in self.groups if g is not group)

    async def _watch(self) -> None:
        """Tell each outage. Down: the group's attempt ended and it failed, or a new attempt
        replaced it (an in-place restart); it went down when herd last saw that attempt
        running. Next commit: the others' step passed their step then. Healed: the group
        steps again, level with the others."""
        while True:
            await asyncio.sleep(WATCH_EVERY)
            now = time.monotonic()
            steps = {g.index: g.step() for g in self.groups}
            for group in self.groups:
                others = [s for i, s in steps.items() if i != group.index and s is not None]
                attempt = group.run.current if group.run is not None else None
                failed = group.result is not None and group.result.exit_code != 0
                replaced = attempt is not None and attempt is not group.seen_attempt
                if group.seen_attempt is not None and (replaced or failed) and not self.interrupted:
                    # The others' step now, not when the group was last seen: a step they
                    # report after this was committed after the loss (their reports lag).
                    self._down(group, max(others, default=group.others_then))
                    group.seen_attempt = None
                if attempt is not None:
                    group.seen_attempt = attempt
                    group.seen_on = group.host
                    group.alive_at = now
                    group.others_then = max(others, default=0)
                self._progress(group, now, steps[group.index], others, attempt)
            self._all_down()

    async def _judge_slow(self) -> None:
        """Name the rank the groups wait for, with its node's word on why (said by its
        group's attempt, as any slow rank), and keep it in the job's record."""
        while True:
            await asyncio.sleep(CHECK_EVERY)
            found = self.slow.check(self.prepared.plan.world_size)
            if found is None:
                continue
            group = next((g for g in self.groups if found.host in g.nodes), None)
            attempt = group.run.current if group is not None and group.run is not None else None
            named = await attempt.slow.announce(found) if attempt is not None else found
            self.record.slow = f"group {group.index if group else '?'}: {named.line()}"
            self._write_record(None)

    def _all_down(self) -> None:
        """Said once each time every group is down at once: none is left to heal from, so
        the groups resume from the run's last snapshot as they restart (torchft keeps
        nothing on disk)."""
        # Down: an outage not healed yet (a group restarted in place is seen running again
        # at once, but it is not back until it steps level with the others).
        down = all(g.outages and g.outages[-1].healed_s is None for g in self.groups)
        if down and not self.all_down_said and not self.interrupted:
            self.note(
                "every replica group is down: as they restart, they resume from the run's "
                "last snapshot (the steps since it are trained again)"
            )
        self.all_down_said = down

    def _down(self, group: Group, steps: int) -> None:
        # The node it was last seen running on (it may have moved to a spare since).
        outage = Outage(group.index, group.seen_on, group.alive_at, steps)
        group.outages.append(outage)
        # Its ranks' next attempt starts afresh (a warm-up), wherever it runs.
        self.slow.forget([*group.seen_on.split(","), *group.nodes])
        self.note(
            f"replica group {group.index} on {outage.host} went down at step "
            f"{outage.steps_before}; the other groups go on without it"
        )
        self._write_record(None)

    def _progress(
        self, group: Group, now: float, mine: int | None, others: list[int], attempt: object
    ) -> None:
        if not group.outages:
            return
        outage = group.outages[-1]
        if outage.next_commit_s is None and others and max(others) > outage.steps_before:
            # (the others' step reports come about once a second: this is an upper bound)
            outage.next_commit_s = round(now - outage.down_at, 2)
            self.note(
                f"group {group.index} is out; the other groups committed step {max(others)} "
                f"{outage.next_commit_s:.1f} s after it went down"
            )
            self._write_record(None)
        if (
            outage.healed_s is None
            and attempt is not None
            and mine is not None
            and mine > outage.steps_before
            and (not others or mine >= min(others) - 1)
        ):
            outage.healed_s = round(now - outage.down_at, 2)
            self.note(
                f"group {group.index} on {group.host} rejoined and healed at step {mine}, "
                f"{outage.healed_s:.1f} s after it went down"
            )
            self._write_record(None)

    def _result(self, duration: float) -> RunResult:
        results = [g.result for g in self.groups]
        if self.interrupted:
            code, reason = EXIT_INTERRUPTED, "interrupted"
        elif all(r is not None and r.exit_code == 0 for r in results):
            code, reason = 0, ""
        elif any(r is not None and r.exit_code == 0 for r in results):
            lost = [g for g in self.groups if g.result is None or g.result.exit_code != 0]
            code = 0
            reason = "finished without group(s) " + ", ".join(f"{g.index} ({g.host})" for g in lost)
        else:
            code, reason = EXIT_JOB_FAILED, "every replica group failed"
        result = RunResult(self.job.job_id, code, reason=reason, log_dir=self.log_dir)
        result.duration = duration
        result.restarts = sum(max(0, g.runs - 1) for g in self.groups)
        return result

    def _write_record(self, result: RunResult | None) -> None:
        self.record.groups = [
            {
                "group": g.index,
                "host": g.host,
                "nodes": list(g.nodes),
                "hosts": g.hosts,
                "runs": g.runs,
                "exit_code": g.result.exit_code if g.result is not None else None,
                "outages": [o.entry() for o in g.outages],
            }
            for g in self.groups
        ]
        if result is None:
            self.record.save()
        else:
            finish_record(self.record, result, list(self.prepared.plan.secret_env.values()))


__all__ = ["GroupsRun", "Outage", "group_env", "lighthouse_job", "split_into_groups"]
