"""One attempt of a job: a plan run on its nodes through their agent links, watched, ended.

``Attempt`` wires the parts and runs them: it opens (or reuses) each node's agent link, sends
it the run request (request.py) and hands the link's events to the handlers (events.py); the
watch (watch.py), the slow-rank watch (slow_ranks.py) and the pings (actions.py) run beside
them. Everything they learn goes into one ``LiveState`` (state.py); everything they tell the
agents goes through ``AttemptActions`` (actions.py) and teardown.Teardown.

The attempt is over when every node is done with it: its agent reported the attempt's exit,
or its link ended, or herd cut it off. What ends it early: a node that fails or whose link
ends (events.py), a node gone silent or a hang (watch.py), ``interrupt()`` (Ctrl-C, SIGTERM,
SIGHUP) or a time limit (``request_save``). Once over, its state is frozen into an
``outcome.AttemptState`` and the outcome reads only that (``ended_state``, ``result_of``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...logs import JobOutput
from ...plan import LaunchPlan
from ...recovery import Evidence, HangWatch, NodeLiveness
from ...recovery.failures import NodeRun, NodeState
from ...recovery.liveness import SILENCE
from ...recovery.straggler import Slow, StepTiming
from ...spec import ClusterSpec
from ...transport import Transport
from ..links import AgentLink
from ..outcome import AttemptResult, AttemptState, result_of
from ..slow_ranks import SlowRanks
from ..teardown import Teardown
from .actions import AttemptActions
from .events import AgentEvents
from .request import agent_request
from .state import LiveState
from .watch import AttemptWatch


class Attempt:
    """One attempt: what the job starts, signals (``interrupt``, ``request_save``), reads
    while it runs (``state``) and gets back (``run`` -> AttemptResult)."""

    def __init__(
        self,
        plan: LaunchPlan,
        cluster: ClusterSpec,
        transport: Transport,
        output: JobOutput,
        links: dict[str, AgentLink],
        *,
        number: int = 0,
        hang: HangWatch | None = None,
        silence: float = SILENCE,
        evidence_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        prewarm_next: bool = False,
        on_slow: Callable[[Slow], None] | None = None,
        on_timing: Callable[[str, int, StepTiming], None] | None = None,
        send: dict[str, Any] | None = None,
        on_first_step: Callable[[], None] | None = None,
    ) -> None:
        self.plan = plan
        self.cluster = cluster
        self.transport = transport
        self.output = output
        output.attempt_started()
        self.links = links
        """The job's links by host, shared: new ones are added, ended ones stay (ended)."""
        self.number = number
        self.send = send
        """Which worker lines the agents send (None: all; see agent_request)."""
        self.state = LiveState(plan, number)
        self.hang = hang if hang is not None else HangWatch(clock=clock)
        self.hang.world_size = plan.world_size
        self.liveness = NodeLiveness(self.state.nodes, silence=silence, clock=clock)
        self.evidence = Evidence(evidence_dir or output.log_dir / "stacks" / f"attempt-{number}")
        self.teardown = Teardown(plan, cluster, transport, links, output, clock)
        self.actions = AttemptActions(
            self.state, links, self.teardown, output, self.evidence, prewarm_next=prewarm_next
        )
        self.slow = SlowRanks(
            links,
            self.state.running,
            self.hang.silent_for,
            plan.world_size,
            output.note,
            on_slow,
            on_timing,
            start_over=lambda: (
                self.hang.progressed_yet or len(self.state.running()) == len(plan.nodes)
            ),
        )
        self.events = AgentEvents(
            self.state,
            self.actions,
            cluster=cluster,
            transport=transport,
            teardown=self.teardown,
            output=output,
            liveness=self.liveness,
            hang=self.hang,
            slow=self.slow,
            evidence=self.evidence,
            clock=clock,
            on_first_step=on_first_step,
        )
        self.watch = AttemptWatch(
            self.state,
            self.actions,
            cluster=cluster,
            links=links,
            teardown=self.teardown,
            output=output,
            liveness=self.liveness,
            hang=self.hang,
            silence=silence,
            clock=clock,
        )

    # -- what the job asks --------------------------------------------------------------------

    def interrupt(self) -> None:
        """Ctrl-C or SIGTERM: stop every node; a second one kills every worker at once."""
        self.actions.interrupt()

    def request_save(self, within: float, grow: str = "") -> None:
        """Ask every worker to save and stop; stop what still runs after ``within`` s."""
        self.actions.request_save(within, grow)

    # -- running --------------------------------------------------------------------------------

    async def run(self) -> AttemptResult:
        started = time.monotonic()
        openers = [
            asyncio.create_task(self._start_node(node)) for node in self.state.nodes.values()
        ]
        self.output.flush_on(asyncio.get_running_loop())
        helpers = [
            asyncio.create_task(self.actions.ping_agents(self.cluster.launcher_silence)),
            asyncio.create_task(self.watch.run()),
            asyncio.create_task(self.slow.run()),
        ]
        try:
            await asyncio.gather(*openers)
            self.actions.check_over()
            await self.actions.over.wait()
            await self.teardown.finish_sweeps()
        finally:
            for task in [*helpers, *openers]:
                task.cancel()
            for node in self.state.nodes.values():
                link = self.links.get(node.host)
                if link is not None and link.on_event is not None:
                    link.on_event = None
                    link.on_text = None
        return await asyncio.to_thread(result_of, self.ended_state(), time.monotonic() - started)

    async def _start_node(self, node: NodeRun) -> None:
        link = self.links.get(node.host)
        if link is None or not link.alive:
            try:
                link = await AgentLink.open(
                    self.transport, self.cluster, self.cluster.node(node.host)
                )
            except OSError as exc:
                node.error = {"message": f"cannot start the agent: {exc}", "remedy": ""}
                node.state = NodeState.NOT_STARTED
                self.actions.done(node)
                return
            self.links[node.host] = link
        link.on_event = lambda event, n=node: self.events.handle(n, event)
        link.on_text = lambda text, n=node: self.output.line(n.host, None, text)
        link.start_reading()
        self.state.start_marks[node.host]["requested"] = time.monotonic()
        link.run(agent_request(self.plan, node.plan, self.cluster.launcher_silence, self.send))
        if self.state.stopping:
            self.actions.tell_stop(node)
        asyncio.create_task(self._watch_link(node, link))

    async def _watch_link(self, node: NodeRun, link: AgentLink) -> None:
        await link.ended.wait()
        if not node.done:
            node.exit_code = link.exit_code
            node.stderr.extend(link.stderr)
            node.ended_at = time.monotonic()
            self.events.link_ended(node, link)

    # -- the result -----------------------------------------------------------------------------

    def ended_state(self) -> AttemptState:
        """This attempt as it ended, frozen: what outcome.result_of reads."""
        state = self.state
        return AttemptState(
            job_id=self.plan.job_id,
            number=self.number,
            log_dir=self.output.log_dir,
            states={host: node.state for host, node in state.nodes.items()},
            reusable=tuple(
                host
                for host, node in state.nodes.items()
                if node.state in (NodeState.SUCCEEDED, NodeState.FAILED, NodeState.STOPPED)
                and host not in state.survivors
                and (link := self.links.get(host)) is not None
                and link.alive
            ),
            unconfirmed=tuple(dict.fromkeys([*self.teardown.unconfirmed(), *state.survivors])),
            interrupted=state.interrupted,
            stopping=state.stopping,
            saving=state.saving,
            saving_for=state.growing,
            saved_after_request=state.saved_after_request,
            stopped_for_silence=state.stopped_for_silence,
            first_failure=state.first_failure(),
            hang_found=state.hang_found,
            never_exited=state.never_exited,
            behind=tuple(state.behind),
            evidence=self.evidence,
            steps=dict(self.hang.steps),
            max_step=self.hang.max_step,
            noticed=state.noticed or "",
            ranks_seen=frozenset(state.ranks_seen),
        )
