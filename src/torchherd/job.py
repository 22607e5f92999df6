"""A job is a sequence of attempts: run one, decide the next, until the job is over.

    attempt 0 (the launch's plan)
      -> ended: succeeded | failed | hung | lost node | stopped by its agents | interrupted | saved
      -> the decision (recovery.policy): stop, or restart
      -> the next attempt's nodes (recovery.nodes): the same nodes in place (their agents kept,
         a warm wrapper waiting), or a new plan without lost nodes
      -> attempt n+1, after every node confirmed attempt n ended (or was swept)

An attempt never starts on a node before the previous attempt there has ended: attempts
never overlap. Signals: Ctrl-C, SIGTERM or SIGHUP stop the job (a second one kills it at once);
SIGUSR1 (a scheduler's time-limit warning) asks the workers to save a snapshot and stop, and
no attempt starts after it. The job record keeps one entry per attempt (jobs.attempt_entry).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, TextIO

from .attempt import LARGE_JOB_NODES, Attempt
from .errors import EXIT_CRASH_LOOP, EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_SAVED, HerdError
from .jobs import JobRecord, attempt_entry, job_dir
from .links import AgentLink
from .logs import JobOutput, RunResult, render_summary
from .ops.jobctl import new_record
from .outcome import AttemptResult
from .plan import JobSpec, LaunchPlan, make_plan, node_workers
from .pool import NodePool
from .prepare import Prepared, close_links, replan
from .recovery import HangWatch, RestartPolicy
from .recovery.nodes import NodeChoice, choose_nodes
from .recovery.policy import made_progress
from .recovery.straggler import Slow
from .redact import redact_text
from .spec import ClusterSpec
from .sweeps import sweep_attempt
from .transport import Transport

# Restarts after the agents stopped the job for a silent launcher (this launcher was stopped
# or suspended): not the job's fault, so not counted against --max-restarts, but bounded.
STALL_RESTARTS = 3


def banner(plan: Any, cluster: ClusterSpec) -> str:
    from . import __version__

    where = (
        f"rendezvous {plan.rdzv_endpoint}" if plan.rdzv_endpoint else "standalone on this machine"
    )
    nodes = ", ".join(f"{n.host}×{n.nproc}" for n in plan.nodes)
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
    ) -> None:
        self.prepared = prepared
        self.job = job
        self.transport = transport
        self.hang_timeout = hang_timeout
        self.save_within = save_within
        self.policy = policy or job_policy(job, prepared.cluster)
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
        self.saves_seen = False
        """The job has reported a committed snapshot: it can be asked to save and stop."""
        self.record: JobRecord = new_record(prepared.cluster, plan, self.log_dir, state="running")
        self.number = job.attempt
        self.restarts = 0
        self.stall_restarts = 0
        self.current: Attempt | None = None
        self.replanning: asyncio.Task[Prepared] | None = None
        self.interrupted = False
        self.time_limit = False

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
        await asyncio.to_thread(self.record.save)
        self.output.note(banner(plan, self.prepared.cluster))
        for warning in plan.warnings:
            self.output.note(f"herd: warning: {warning}")
        self.output.until_first_line(f"starting {plan.world_size} worker(s)")
        started = time.monotonic()
        best_step: int | None = None
        no_progress = 0
        result: RunResult = RunResult(plan.job_id, EXIT_JOB_FAILED, log_dir=self.log_dir)
        try:
            while True:
                attempt = self._attempt()
                self.current = attempt
                attempt_started = time.monotonic()
                result = outcome = await self._run_attempt(attempt)
                self.current = None
                self.saves_seen = self.saves_seen or attempt.saves > 0
                self._close_entry(outcome)
                self._node_rates(attempt)
                await asyncio.to_thread(self.record.save)
                if self.time_limit or self.interrupted:
                    result = self._stopped_between(outcome)
                    break
                if attempt.growing and outcome.exit_code == EXIT_SAVED:
                    why = attempt.growing
                elif outcome.stopped_by_agents and self.stall_restarts < STALL_RESTARTS:
                    self.stall_restarts += 1
                    why = "the agents stopped the job while this launcher was not running"
                elif not self.policy.should_restart(outcome.exit_code, self.restarts):
                    break
                else:
                    seconds = time.monotonic() - attempt_started
                    if made_progress(best_step, outcome.max_step, seconds):
                        no_progress = 0
                    elif self.restarts:  # a restart that got nowhere: the crash loop counts
                        no_progress += 1
                    if outcome.max_step is not None:
                        best_step = max(best_step or 0, outcome.max_step)
                    if no_progress >= self.policy.crash_loop:
                        result.exit_code = EXIT_CRASH_LOOP
                        result.reason = (
                            f"crash loop: {no_progress} restart(s) in a row failed without step "
                            f"progress (best step {best_step if best_step is not None else 'none'})"
                            "; fix the first failure above, restarting will not"
                        )
                        break
                    self.restarts += 1
                    cause = outcome.first_failure.headline() if outcome.first_failure else ""
                    why = cause or "a node failed"
                    self.output.note(
                        f"herd: {why}; restarting the job (restart {self.restarts} of "
                        f"{self.policy.max_restarts})"
                    )
                if not await self._next(outcome, why):
                    result = (
                        self._stopped_between(outcome)
                        if (self.time_limit or self.interrupted)
                        else outcome
                    )
                    break
        finally:
            await self._close_links()
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
        tending = asyncio.create_task(self.pool.tend(self.job, lambda: members))
        growing = asyncio.create_task(self._grow_when_back(attempt))
        try:
            return await attempt.run()
        finally:
            for task in (tending, growing):
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
            if (self.saves_seen or attempt.saves) and not (self.time_limit or attempt.stopping):
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
            evidence_dir=self.log_dir / "stacks" / f"attempt-{self.number}",
            prewarm_next=self.restarts < self.policy.max_restarts,
            on_slow=self._slow,
            send=self._sent_lines(plan),
        )

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

    def _slow(self, slow: Slow) -> None:
        """A slow rank named: in the job record at once (`herd top` shows it)."""
        self.record.attempts[-1].setdefault("slow", []).append(slow.line())
        self.record.slow = slow.line()
        asyncio.get_running_loop().create_task(asyncio.to_thread(self.record.save))

    async def _next(self, outcome: AttemptResult, why: str) -> bool:
        """Plan the next attempt: in place when every node is still there, else on the nodes
        recovery.nodes chooses; False when the job cannot go on (the reason is in the output
        and the result)."""
        last = self.prepared.plan
        self.number += 1
        job = replace(self.job, attempt=self.number)
        current = [n.host for n in last.nodes]
        lost = {h for h in current if h in set(outcome.lost) | set(outcome.unconfirmed)}
        grow = bool(self.pool.returned) and len(current) < self.size
        if not lost and not grow and set(current) <= set(outcome.reusable):
            prepared = self.prepared
            plan = make_plan(
                prepared.cluster.select(current), job, prepared.facts, prepared.secrets
            )
            self.prepared = Prepared(self.full_cluster, prepared.facts, prepared.secrets, plan)
            how = "in place"
        else:
            choice = await self._choose(current, lost, last, outcome)
            if choice is None:
                return False
            self.replanning = asyncio.create_task(
                replan(
                    Prepared(self.full_cluster, self.pool.facts, self.prepared.secrets, last),
                    job,
                    self.transport,
                    nodes=list(choice.nodes),
                    links={h: link for h, link in self.links.items() if h not in lost},
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
        await asyncio.to_thread(self.record.save)
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
        return True

    async def _choose(
        self, current: list[str], lost: set[str], last: LaunchPlan, outcome: AttemptResult
    ) -> NodeChoice | None:
        """The next attempt's nodes (recovery.nodes) when the last attempt's cannot all be used
        as they are. Lost nodes the job cannot go on without are waited for: swept now (which
        tells too whether they answer); None when too few nodes remain."""
        plans = {n.host: n for n in last.nodes}

        def choose(still_lost: set[str]) -> NodeChoice:
            return choose_nodes(
                [n.host for n in self.full_cluster.nodes],
                current,
                still_lost,
                nproc=self._workers(),
                spares=self.pool.spares,
                returned=self.pool.returned,
                min_nodes=self.policy.min_nodes,
                size=self.size,
            )

        choice = choose(lost)
        if choice.waiting:
            answers = await asyncio.gather(
                *(
                    sweep_attempt(
                        self.transport,
                        self.full_cluster,
                        last.job_id,
                        plans[h],
                        grace=last.grace,
                        timeout=self.full_cluster.connect_timeout + last.grace + 15,
                    )
                    for h in choice.waiting
                )
            )
            back = {h for h, swept in zip(choice.waiting, answers, strict=True) if swept.confirmed}
            for host in back:
                self.links.pop(host, None)  # its old agent is gone: a new one is opened
            choice = choose(lost - back)
        if choice.waiting:
            left = len(current) - len(choice.waiting)
            needed = self.policy.min_nodes or self.size
            message = (
                f"{', '.join(choice.waiting)} still do(es) not answer: {left} node(s) left, "
                f"{needed} needed"
            )
            self.output.note(
                f"herd: cannot restart: {message}\n  fix: bring the node back, or allow going "
                "on with fewer nodes (--min-nodes M, or min_nodes in [cluster]), or keep a "
                "spare (spare = true on a [[node]], or --spares N)"
            )
            outcome.reason = message
            return None
        self.pool.leave_out(choice.left_out, plans)
        self.pool.take(tuple(choice.nodes))
        if choice.changed:
            self.output.note(f"herd: {choice.describe()}")
        return choice

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

    def _stopped_between(self, outcome: AttemptResult) -> RunResult:
        """The job ends for a signal that came during or after an attempt."""
        if self.interrupted and outcome.exit_code not in (0, EXIT_SAVED):
            outcome.exit_code = EXIT_INTERRUPTED
            return outcome
        if self.time_limit and outcome.exit_code != EXIT_SAVED and outcome.exit_code != 0:
            if not outcome.reason:
                outcome.reason = (
                    "the time limit came while the job was restarting; no attempt was started "
                    "after it and no snapshot was committed after it: the last snapshot stands"
                )
            self.output.note(f"herd: {outcome.reason}")
        return outcome

    def _node_rates(self, attempt: Attempt) -> None:
        """Each node's own step rate in the attempt's entry (`herd report` draws it)."""
        rates = attempt.step_rates()
        for node in self.record.attempts[-1].get("nodes", []):
            found = rates.get(str(node.get("host")))
            if found is not None and found[1] is not None:
                node["step"], node["steps_per_s"] = found

    def _close_entry(self, result: AttemptResult) -> None:
        entry = self.record.attempts[-1]
        entry["ended"] = time.time()
        entry["outcome"] = outcome_of(result)
        entry["noticed"] = result.noticed
        entry["behind"] = list(result.behind)
        entry["stacks_dir"] = str(result.stacks_dir) if result.stacks_dir else None
        entry["max_step"] = result.max_step
        entry["failure"] = failure_record(result, self.secrets)


def outcome_of(result: RunResult) -> str:
    if result.exit_code == 0:
        return "succeeded"
    if result.exit_code == EXIT_SAVED:
        return "saved"
    if result.exit_code == EXIT_INTERRUPTED:
        return "interrupted"
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
    record.state = {0: "succeeded", EXIT_INTERRUPTED: "stopped", EXIT_SAVED: "saved"}.get(
        result.exit_code, "failed"
    )
    record.ended = time.time()
    record.exit_code = result.exit_code
    record.restarts = result.restarts
    if result.first_failure is not None:
        record.first_failure = failure_record(result, secrets)
    record.save()


__all__ = ["JobRun", "banner", "finish_record", "job_policy"]
