"""A job is a sequence of attempts: run one, decide the next, until the job is over.

    attempt 0 (the launch's plan)
      -> ended: succeeded | failed | hung | lost node | stopped by its agents | interrupted | saved
      -> the decision (recovery.policy.RestartPolicy.decide, pure): stop with an exit code and a
         reason, or restart on the next attempt's nodes: the same nodes in place (their agents
         kept, a warm wrapper waiting), or a new plan without lost or set-aside nodes (a spare
         in a lost node's place, nodes that came back added); or first sweep lost nodes the job
         cannot go on without, and decide again
      -> attempt n+1, after every node confirmed attempt n ended (or was swept)

JobRun only gathers what the decision reads and carries it out: the attempts, the replanning
and the sweeps are given to it (real ones by default), so a test drives the loop with fakes.

An attempt never starts on a node before the previous attempt there has ended: attempts
never overlap. Signals: Ctrl-C, SIGTERM or SIGHUP stop the job (a second one kills it at once);
SIGUSR1 (a scheduler's time-limit warning) asks the workers to save a snapshot and stop, and
no attempt starts after it. The job record keeps one entry per attempt (jobs.attempt_entry).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, TextIO

from ..errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_NEVER_EXITED, EXIT_SAVED, HerdError
from ..hostlist import nodes_in_words
from ..job_nodes import new_record
from ..logs import JobOutput, render_summary
from ..plan import JobSpec, LaunchPlan, NodePlan, make_plan, node_workers
from ..records import JobRecord, attempt_entry, job_dir
from ..recovery import HangWatch, RestartPolicy
from ..recovery.policy import Action, Bench, Decision, Ended, History, Signals
from ..recovery.straggler import Slow, StepTiming
from ..redact import redact_text
from ..results import RunResult
from ..spec import ClusterSpec
from ..startup import FIRST_START, RESTART, breakdown
from ..startup import render as render_phases
from ..transport import Transport
from .attempt import LARGE_JOB_NODES, Attempt
from .links import AgentLink
from .outcome import AttemptResult
from .pool import NodePool
from .prepare import Prepared, close_links, replan
from .sweeps import sweep_attempt

Replanner = Callable[..., Coroutine[Any, Any, Prepared]]
"""prepare.replan's shape: the plan of a restart on the given nodes."""
Sweeper = Callable[[LaunchPlan, NodePlan], Awaitable[bool]]
"""Sweeps a node's part of an attempt; True when the node answered and confirmed its end."""


def banner(plan: Any, cluster: ClusterSpec) -> str:
    from .. import __version__

    where = (
        f"rendezvous {plan.rdzv_endpoint}" if plan.rdzv_endpoint else "standalone on this machine"
    )
    nodes = nodes_in_words((n.host, n.nproc) for n in plan.nodes)
    return (
        f"herd {__version__}: job {plan.job_id} on {len(plan.nodes)} node(s) [{nodes}], "
        f"world size {plan.world_size}, {where}"
    )


def sent_lines(
    nodes: int, ranks: frozenset[int] | None, every_rank: bool = False
) -> dict[str, Any] | None:
    """Which worker lines the agents send the launcher: all (None) on jobs of up to
    LARGE_JOB_NODES nodes or with --ranks all; on larger ones the shown ranks' (rank 0 by
    default) and every rank's stderr, since the launcher of a thousand nodes cannot take
    every line. The rest stay in the nodes' files."""
    if nodes <= LARGE_JOB_NODES or every_rank:
        return None
    return {"ranks": sorted(ranks) if ranks is not None else [0], "stderr": True}


class JobRun:
    """Runs a prepared job to its end: attempts, restarts, signals, the record, the summary."""

    def __init__(
        self,
        prepared: Prepared,
        job: JobSpec,
        transport: Transport,
        *,
        stream: TextIO,
        hang_timeout: float | None = None,
        save_within: float = 60.0,
        log_dir: Any = None,
        color: bool | None = None,
        policy: RestartPolicy | None = None,
        ranks: frozenset[int] | None = None,
        every_rank: bool = False,
        attempts: Callable[[JobRun], Attempt] | None = None,
        replanner: Replanner = replan,
        sweeper: Sweeper | None = None,
        verbose: bool = False,
        on_timing: Callable[[str, int, StepTiming], None] | None = None,
    ) -> None:
        self.prepared = prepared
        self.job = job
        self.transport = transport
        self.hang_timeout = hang_timeout
        self.save_within = save_within
        self.policy = policy or job_policy(job, prepared.cluster)
        self.new_attempt: Callable[[JobRun], Attempt] = attempts or JobRun._attempt
        """Starts the next attempt on the current plan (a test passes a fake)."""
        self.replan = replanner
        self.sweep: Sweeper = sweeper or self.sweep_lost_node
        self.on_timing = on_timing
        """Every rank's step timing also goes here (replica groups judge across groups)."""
        self.full_cluster = prepared.cluster
        """Every node the job may use (the plan may use fewer after a loss)."""
        plan = prepared.plan
        self.log_dir = log_dir or job_dir(plan.job_id)
        self.secrets = list(plan.secret_env.values())
        self.output = JobOutput(
            self.log_dir,
            [n.host for n in self.full_cluster.nodes],
            plan.world_size,
            stream=stream,
            color=color,
            secrets=self.secrets,
            ranks=ranks,
        )
        self.ranks = ranks
        """The ranks whose lines the console shows (--ranks; None: every rank)."""
        self.every_rank = every_rank
        """--ranks all: every line to the launcher, however large the job."""
        self.links: dict[str, AgentLink] = dict(prepared.links)
        for link in self.links.values():
            link.start_reading()  # a link that ends is known as ended, used or idle
        self.pool = NodePool(
            self.full_cluster, transport, self.links, dict(prepared.facts), self.output.note
        )
        self.size = len(self.full_cluster.active)
        """Nodes the job runs on when none is lost: the cluster's, spares aside."""
        self.history = History()
        self.swapping: str | None = None
        """The node the current attempt saves and stops to swap out (--swap-slow)."""
        """What the restart decisions so far leave for the next one."""
        self._save_lock = asyncio.Lock()
        self._saves: set[asyncio.Task[None]] = set()
        """Saves started by a callback (a slow rank named): awaited before the last one."""
        self.record: JobRecord = new_record(prepared.cluster, plan, self.log_dir, state="running")
        self.number = job.attempt
        self.restarts = 0
        self.current: Attempt | None = None
        self.last_attempt: Attempt | None = None
        self.replanning: asyncio.Task[Prepared] | None = None
        self.interrupted = False
        self.time_limit = False
        self.limit_between = False
        """The time limit came while no attempt ran (none could be asked to save)."""
        self.verbose = verbose
        """herd launch -v: each start's phases on the console once its first step is made."""
        self.start_origin: float | None = prepared.origin
        """Where the current attempt's start is counted from (startup.py): the command for
        the first, the moment herd saw the attempt before end for a restart."""
        self.start_marks: dict[str, dict[str, float]] = {
            h: dict(m) for h, m in prepared.marks.items()
        }
        """Marks of the current attempt's start gathered before it ran (connect, probe; a
        restart's nodes confirming the last attempt's end)."""
        self._phases_kept = False

    # -- signals --------------------------------------------------------------------------------

    def interrupt(self) -> None:
        """Ctrl-C, SIGTERM, SIGHUP: stop the job (a second time: kill it now)."""
        first = not self.interrupted
        self.interrupted = True
        if self.current is not None:
            self.current.interrupt()
        elif first:
            self.output.note("herd: stopping the job")
        if self.replanning is not None:
            self.replanning.cancel()

    def save_and_stop(self) -> None:
        """SIGUSR1, a time limit is near: save and stop now; no attempt starts after it."""
        if self.time_limit:
            return
        self.time_limit = True
        if self.current is None or self.current.state.stopping:
            # No attempt runs that could still save: the job ends before the next would start.
            self.limit_between = True
        if self.current is not None:
            self.current.request_save(self.save_within)
        if self.replanning is not None:
            self.replanning.cancel()

    # -- the attempts ---------------------------------------------------------------------------

    async def run(self) -> RunResult:
        plan = self.prepared.plan
        self.record.attempts.append(
            attempt_entry(self.number, self.record.nodes, plan.world_size, plan.rdzv_endpoint)
        )
        await self._save()
        self.output.note(banner(plan, self.prepared.cluster))
        for warning in plan.warnings:
            self.output.note(f"herd: warning: {warning}")
        self.output.until_first_line(f"starting {plan.world_size} worker(s)")
        started = time.monotonic()
        result: RunResult = RunResult(plan.job_id, EXIT_JOB_FAILED, log_dir=self.log_dir)
        try:
            while True:
                attempt = self.new_attempt(self)
                self.current = self.last_attempt = attempt
                attempt_started = time.monotonic()
                result = outcome = await self._run_attempt(attempt)
                self.current = None
                self._keep_phases(attempt)
                self._close_entry(outcome)
                self._node_rates(attempt)
                await self._save()
                before = replace(
                    self.history, saves_seen=self.history.saves_seen or attempt.state.saves > 0
                )
                ended = self._ended(attempt, outcome, time.monotonic() - attempt_started)
                self.swapping = None
                decision = await self._decide(ended, before, attempt.plan)
                self.history = decision.history
                if decision.action is Action.STOP:
                    result = self._stop(outcome, decision)
                    break
                if decision.counted:
                    self.restarts = decision.history.restarts
                    self.output.note(
                        f"herd: {decision.why}; restarting the job (restart {self.restarts} of "
                        f"{self.policy.max_restarts})"
                    )
                if not await self._next(outcome, decision):
                    if self.time_limit or self.interrupted:
                        # A signal while replanning: acted on before any attempt starts.
                        stop = self.policy.decide(ended, self._bench(), before, self._signals())
                        result = self._stop(outcome, stop)
                    break
        finally:
            await self._close_links()
            if self._saves:
                await asyncio.gather(*self._saves, return_exceptions=True)
            result.restarts = self.restarts
            result.duration = time.monotonic() - started
            self.output.note(render_summary(result))
            self.output.close()
            finish_record(self.record, result, self.secrets)
        return result

    async def _run_attempt(self, attempt: Attempt) -> AttemptResult:
        """Run one attempt while the pool keeps the idle nodes ready and watches for nodes
        coming back (which grows the job at its next snapshot)."""
        self.pool.warm(self.number + 1)
        members = [n.host for n in attempt.plan.nodes]
        helpers = []
        # Only a pool with nodes in it has work while the attempt runs (nodes are left out
        # between attempts, and only left-out nodes come back): an empty one wakes nobody.
        if self.pool.idle() or self.pool.left_out:
            helpers.append(asyncio.create_task(self.pool.tend(self.job, lambda: members)))
            helpers.append(asyncio.create_task(self._grow_when_back(attempt)))
        try:
            return await attempt.run()
        finally:
            for task in helpers:
                task.cancel()

    async def _grow_when_back(self, attempt: Attempt) -> None:
        """Once a left-out node is back and the job can save, ask the workers to save and
        stop: the next attempt runs on more nodes. A job that never saved grows at its next
        restart instead (stopping it would lose its progress)."""
        while True:
            await asyncio.sleep(1.0)
            room = self.size - len(attempt.plan.nodes)
            if not self.pool.returned:
                continue
            if room <= 0:
                self.pool.stand_by(list(self.pool.returned))
                continue
            saved = self.history.saves_seen or attempt.state.saves
            if saved and not (self.time_limit or attempt.state.stopping):
                back = ", ".join(self.pool.returned[:room])
                attempt.request_save(self.save_within, grow=f"{back} back: growing the job")
                return

    def _attempt(self) -> Attempt:
        plan = self.prepared.plan
        return Attempt(
            plan,
            self.full_cluster,
            self.transport,
            self.output,
            self.links,
            number=self.number,
            hang=HangWatch(self.hang_timeout),
            silence=self.full_cluster.link_silence,
            evidence_dir=self.log_dir / "stacks" / f"attempt-{self.number}",
            prewarm_next=self.restarts < self.policy.max_restarts,
            on_slow=self._slow,
            on_timing=self.on_timing,
            send=self._sent_lines(plan),
            on_first_step=self._started,
        )

    def _started(self) -> None:
        """Every node made its first step: the start's phases into the record (and onto the
        console with -v), and, while restarts are left, the next attempt's wrappers warmed
        (now, so that their import of torch does not slow this attempt's start)."""
        if self.current is not None:
            self._keep_phases(self.current)
            self.current.actions.warm_next_everywhere()
            task = asyncio.get_running_loop().create_task(self._save())
            self._saves.add(task)
            task.add_done_callback(self._saves.discard)

    def _keep_phases(self, attempt: Attempt) -> None:
        """The attempt's start, phase by phase (startup.breakdown), in its record entry: once,
        at its first step, else (a start that never got there) as far as it got."""
        if self._phases_kept or self.start_origin is None:
            return
        self._phases_kept = True
        own = attempt.state.start_marks
        marks = {host: {**self.start_marks.get(host, {}), **own[host]} for host in own}
        if not marks:
            return
        restart = self.number != self.job.attempt
        found = breakdown(
            self.start_origin, marks, RESTART if restart else FIRST_START, restart=restart
        )
        entry = self.record.attempts[-1]
        entry["phases"] = found["phases"]
        entry["phases_slowest"] = found["slowest"]
        entry["start_seconds"] = found["total"]
        entry["start_complete"] = found["complete"]
        for node in entry.get("nodes", []):
            mine = found["nodes"].get(str(node.get("host")))
            if mine is not None:
                node["phases"] = mine
        if self.verbose:
            for line in render_phases(found, self.number, restart):
                self.output.note(line)

    def _sent_lines(self, plan: LaunchPlan) -> dict[str, Any] | None:
        """Which worker lines the agents send (sent_lines), said once on a large job."""
        send = sent_lines(len(plan.nodes), self.ranks, self.every_rank)
        if send is not None and not self.record.lines_on_nodes:
            self.record.lines_on_nodes = True
            shown = send["ranks"]
            which = "rank 0" if shown == [0] else f"ranks {', '.join(map(str, shown))}"
            self.output.note(
                f"herd: {len(plan.nodes)} nodes: the console shows {which} and every rank's "
                f"stderr; every line is kept on its node (herd logs {plan.job_id} --rank R, "
                "or --ranks all to see them live)"
            )
        return send

    async def _save(self) -> None:
        """Write the job record: one write at a time (job.json has one writer, this job)."""
        async with self._save_lock:
            text = self.record.text()  # in the loop, where the record changes: whole, newest
            await asyncio.to_thread(self.record.save, text)

    def _slow(self, slow: Slow) -> None:
        """A slow rank named: in the job record at once (`herd top` shows it), with each
        node's step times so far."""
        self.record.attempts[-1].setdefault("slow", []).append(slow.line())
        for node in self.record.attempts[-1].get("nodes", []):
            if node.get("host") == slow.host:  # where the report's strip marks it
                node.setdefault("named_slow_at", time.time())
        if self.current is not None:  # the step times up to here: a running job's report
            self._node_rates(self.current)
        self.record.slow = slow.line()
        task = asyncio.get_running_loop().create_task(self._save())
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)
        if self.job.swap_slow is not None and self.current is not None:
            swap = asyncio.get_running_loop().create_task(self._swap_if_still_slow(slow))
            self._saves.add(swap)
            swap.add_done_callback(self._saves.discard)

    async def _swap_if_still_slow(self, slow: Slow) -> None:
        """--swap-slow: the node named slow is still the slowest ``swap_slow`` seconds later:
        ask the workers to save and stop (at once if the job has saved before, else at its
        first snapshot), and the next attempt leaves the node out, a spare in its place, or
        fewer nodes where --min-nodes allows (recovery.policy); else it stays, said once."""
        attempt = self.current
        assert attempt is not None and self.job.swap_slow is not None
        await asyncio.sleep(self.job.swap_slow)
        while self.current is attempt and not attempt.state.stopping:
            if not attempt.slow.watch.still_slow(slow.host, slow.rank):
                self.output.note(f"herd: {slow.host} is no longer the slowest: it stays")
                return
            spare = next((h for h in self.pool.spares if self.pool.answering(h)), None)
            fewer = len(attempt.plan.nodes) - 1 >= (self.policy.min_nodes or self.size)
            if spare is None and not fewer:
                self.output.note(
                    f"herd: {slow.host} is still slow, but no spare can take its place "
                    "(spare = true on a [[node]], --spares N, or --min-nodes to go on without it)"
                )
                return
            if self.history.saves_seen or attempt.state.saves:
                self.swapping = slow.host
                instead = f"spare {spare} takes its place" if spare else "going on without it"
                attempt.request_save(
                    self.save_within,
                    grow=f"{slow.host} is still slow {self.job.swap_slow:g} s after it was "
                    f"named: swapping it out ({instead})",
                )
                return
            await asyncio.sleep(1.0)  # no snapshot yet: stopping now would lose the progress

    def _ended(self, attempt: Attempt, outcome: AttemptResult, seconds: float) -> Ended:
        """What the decision reads of an attempt's outcome."""
        current = tuple(n.host for n in attempt.plan.nodes)
        gone = set(outcome.lost) | set(outcome.unconfirmed)
        failure = outcome.first_failure
        return Ended(
            exit_code=outcome.exit_code,
            nodes=current,
            lost=frozenset(h for h in current if h in gone),
            reusable=frozenset(outcome.reusable),
            max_step=outcome.max_step,
            seconds=seconds,
            growing=attempt.state.growing,
            swap_out=(self.swapping,) if self.swapping and attempt.state.growing else (),
            stopped_by_agents=outcome.stopped_by_agents,
            failed_host=failure.host if failure is not None and failure.host else None,
            cause=failure.headline() if failure is not None else "",
        )

    def _bench(self) -> Bench:
        """The nodes the next attempt may use: spares whose agent still answers, nodes back."""
        spares = tuple(h for h in self.pool.spares if self.pool.answering(h))
        return Bench(
            order=tuple(n.host for n in self.full_cluster.nodes),
            size=self.size,
            nproc=self._workers(),
            spares=spares,
            returned=tuple(self.pool.returned),
        )

    def _signals(self) -> Signals:
        return Signals(self.interrupted, self.time_limit, self.limit_between)

    async def _decide(self, ended: Ended, history: History, last: LaunchPlan) -> Decision:
        """The policy's decision; lost nodes it cannot do without are swept first (which
        tells too whether they answer) and the decision taken again."""
        bench = self._bench()
        decision = self.policy.decide(ended, bench, history, self._signals())
        if decision.action is not Action.SWEEP:
            return decision
        plans = {n.host: n for n in last.nodes}
        answers = await asyncio.gather(*(self.sweep(last, plans[h]) for h in decision.sweep))
        back = {h for h, ok in zip(decision.sweep, answers, strict=True) if ok}
        for host in back:
            self.links.pop(host, None)  # its old agent is gone: a new one is opened
        for host in set(decision.sweep) - back:
            self.transport.lost(host)
        return self.policy.decide(
            ended, replace(bench, swept=frozenset(back)), history, self._signals()
        )

    async def sweep_lost_node(self, last: LaunchPlan, node: NodePlan) -> bool:
        """End what the last attempt left on a node that was lost (the default sweeper)."""
        swept = await sweep_attempt(
            self.transport,
            self.full_cluster,
            last.job_id,
            node,
            grace=last.grace,
            timeout=self.full_cluster.connect_timeout + last.grace + 15,
        )
        return swept.confirmed

    async def _next(self, outcome: AttemptResult, decision: Decision) -> bool:
        """Plan the next attempt on the decision's nodes: in place, or a new plan; False when
        the job cannot go on (the reason is in the output and the result) or a signal came."""
        last = self.prepared.plan
        self._restart_marks()
        self.number += 1
        job = replace(self.job, attempt=self.number)
        choice = decision.choice
        assert choice is not None
        why = decision.why
        if decision.in_place:
            prepared = self.prepared
            plan = make_plan(
                prepared.cluster.select(list(choice.nodes)), job, prepared.facts, prepared.secrets
            )
            self.prepared = Prepared(self.full_cluster, prepared.facts, prepared.secrets, plan)
            how = "in place"
        else:
            plans = {n.host: n for n in last.nodes}
            aside = {h: self.links[h] for h in decision.set_aside if h in self.links}
            if aside:
                await close_links(aside)
            aside_too = tuple(h for h in decision.set_aside if h not in choice.left_out)
            self.pool.leave_out(choice.left_out + aside_too, plans, decision.set_aside)
            self.pool.take(tuple(choice.nodes))
            if choice.changed:
                self.output.note(f"herd: {choice.describe()}")
            gone = set(choice.left_out)
            self.replanning = asyncio.create_task(
                self.replan(
                    Prepared(self.full_cluster, self.pool.facts, self.prepared.secrets, last),
                    job,
                    self.transport,
                    nodes=list(choice.nodes),
                    links={h: link for h, link in self.links.items() if h not in gone},
                )
            )
            try:
                fresh = await self.replanning
            except asyncio.CancelledError:
                return False
            except HerdError as exc:
                self.output.note(f"herd: cannot restart: {exc.message}\n  fix: {exc.remedy}")
                outcome.reason = exc.message
                return False
            finally:
                self.replanning = None
            self.links.update(fresh.links)
            self.prepared = Prepared(self.full_cluster, fresh.facts, fresh.secrets, fresh.plan)
            how = "grown" if choice.added else "spare" if choice.replaced else "new plan"
            if choice.changed:
                why = f"{why}; {choice.describe()}"
        if self.time_limit or self.interrupted:
            return False
        plan = self.prepared.plan
        await self._drop_links_outside(plan)
        self.record.nodes = [{"host": n.host, "nproc": n.nproc} for n in plan.nodes]
        self.record.world_size = plan.world_size
        self.record.rdzv_endpoint = plan.rdzv_endpoint
        self.record.restarts = self.restarts
        self.record.attempts.append(
            attempt_entry(
                self.number,
                self.record.nodes,
                plan.world_size,
                plan.rdzv_endpoint,
                how=how,
                why=why,
            )
        )
        await self._save()
        if how == "in place":
            self.output.note(
                f"herd: attempt {self.number} in place on the same {len(plan.nodes)} node(s)"
            )
        elif plan.world_size != last.world_size:
            self.output.note(
                f"herd: attempt {self.number} on {len(plan.nodes)} node(s), world size "
                f"{plan.world_size} (was {last.world_size})"
            )
        else:
            self.output.note(
                f"herd: attempt {self.number} on {len(plan.nodes)} node(s), world size "
                f"{plan.world_size} as before"
            )
        # A signal while the record was written: acted on before the attempt starts.
        return not (self.time_limit or self.interrupted)

    def _restart_marks(self) -> None:
        """A restart's start counts from the moment herd saw the last attempt end; each node's
        first mark is when it confirmed that end."""
        self._phases_kept = False
        self.start_origin = None
        self.start_marks = {}
        if self.last_attempt is None:
            return
        last = self.last_attempt.state
        self.start_origin = last.ending_at
        for host, node in last.nodes.items():
            if node.ended_at is not None:
                self.start_marks[host] = {"stopped": node.ended_at}

    def _workers(self) -> dict[str, int]:
        """Workers per node, for matching a spare to the node it replaces."""
        return {
            node.host: node_workers(node, self.job, self.pool.facts[node.host])
            for node in self.full_cluster.nodes
            if node.host in self.pool.facts
        }

    async def _drop_links_outside(self, plan: Any) -> None:
        """Close the links of nodes the next attempt does not use (idle spares and returned
        nodes keep theirs: they are kept ready)."""
        wanted = {n.host for n in plan.nodes} | set(self.pool.idle())
        dropped = {h: link for h, link in self.links.items() if h not in wanted}
        for host in dropped:
            del self.links[host]
        if dropped:
            await close_links(dropped)

    async def _close_links(self) -> None:
        links, self.links = dict(self.links), {}
        if links:
            await close_links(links)

    def _stop(self, outcome: AttemptResult, decision: Decision) -> RunResult:
        """The job ends as the decision says: its exit code, its reason said once."""
        if decision.exit_code is not None:
            outcome.exit_code = decision.exit_code
        if decision.exit_code == EXIT_SAVED:
            self.output.note(f"herd: {decision.reason}")  # no failure: said, not "gave up"
            return outcome
        if decision.reason:
            outcome.reason = decision.reason
        if decision.fix:
            self.output.note(f"herd: cannot restart: {decision.reason}\n  fix: {decision.fix}")
        elif decision.say:
            self.output.note(f"herd: {decision.reason}")
        return outcome

    def _node_rates(self, attempt: Attempt) -> None:
        """Each node's own step rate and step times in the attempt's entry (`herd report`
        draws them)."""
        rates = attempt.state.step_rates()
        for node in self.record.attempts[-1].get("nodes", []):
            found = rates.get(str(node.get("host")))
            if found is not None and found[1] is not None:
                node["step"], node["steps_per_s"] = found
            series = attempt.state.step_times.get(str(node.get("host")))
            if series is not None and series.points():
                node["step_times"] = series.points()
                node["step_times_measure"] = series.measure

    def _close_entry(self, result: AttemptResult) -> None:
        entry = self.record.attempts[-1]
        entry["ended"] = time.time()
        entry["outcome"] = outcome_of(result)
        entry["noticed"] = result.noticed
        entry["behind"] = list(result.behind)
        entry["stacks_dir"] = str(result.stacks_dir) if result.stacks_dir else None
        entry["max_step"] = result.max_step
        entry["failure"] = failure_record(result, self.secrets)


# What a job (and its attempt) that finished with a rank that never exited is recorded as.
NEVER_EXITED = "finished, a rank never exited"


def outcome_of(result: RunResult) -> str:
    if result.exit_code == 0:
        return "succeeded"
    if result.exit_code == EXIT_SAVED:
        return "saved"
    if result.exit_code == EXIT_INTERRUPTED:
        return "interrupted"
    if result.exit_code == EXIT_NEVER_EXITED:
        return NEVER_EXITED
    if result.hang:
        return "hung"
    if result.lost:
        return "lost"
    if isinstance(result, AttemptResult) and result.stopped_by_agents:
        return "stopped by its agents"
    return "failed"


# The failing rank's last stderr lines the record keeps (the console shows ten): what the
# report page shows under the first failure once the console has scrolled away.
STDERR_KEPT = 20


def failure_record(result: RunResult, secrets: list[str]) -> dict[str, Any] | None:
    failure = result.first_failure
    if failure is None:
        return None
    return {
        "host": failure.host,
        "rank": failure.rank,
        "exitcode": failure.exitcode,
        "signal": failure.signal,
        "message": redact_text(failure.message, secrets),
        "stderr_tail": [redact_text(line, secrets) for line in failure.last_stderr[-STDERR_KEPT:]],
        "cause": failure.cause,
        "remedy": failure.remedy,
    }


def job_policy(job: JobSpec, cluster: ClusterSpec) -> RestartPolicy:
    """The restart policy a job asks for (the command line wins over [cluster])."""
    return RestartPolicy(
        max_restarts=job.max_restarts,
        min_nodes=job.min_nodes if job.min_nodes is not None else cluster.min_nodes,
        crash_loop=job.crash_loop,
    )


def finish_record(record: JobRecord, result: RunResult, secrets: list[str]) -> None:
    """The job record once the launcher is done: never left "running"."""
    record.state = {
        0: "succeeded",
        EXIT_INTERRUPTED: "stopped",
        EXIT_SAVED: "saved",
        EXIT_NEVER_EXITED: NEVER_EXITED,
    }.get(result.exit_code, "failed")
    record.ended = time.time()
    record.exit_code = result.exit_code
    record.restarts = result.restarts
    if result.first_failure is not None:
        record.first_failure = failure_record(result, secrets)
    record.save()


__all__ = ["JobRun", "banner", "finish_record", "job_policy"]
