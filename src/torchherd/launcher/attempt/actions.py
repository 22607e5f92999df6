"""What an attempt tells its agents: stop, die, save, take stacks, warm the next attempt, ping.

Every command to a node's agent leaves from here (the stop and its deadlines through
teardown.Teardown); the event handlers and the watches decide, then call one of these.
Before herd stops workers that are not ending by themselves it takes their stacks: every
node's agent dumps its workers, then stops them (``end_with_evidence``); for a hang, every
node's stacks first, then the stop (``gather=True``), so the stacks show the job as it hung.
A stopping node keeps saying "alive"; one whose agent has not reported the attempt's end
within the grace period plus the agent's teardown budget is cut off and then swept (an
attempt-scoped stop run through a new session: teardown.py), so no process of this attempt
outlives it unnoticed and the next attempt never meets it.
"""

from __future__ import annotations

import asyncio
import time

from ...logs import JobOutput
from ...recovery import Evidence
from ...recovery.failures import NodeRun, NodeState
from ..links import AgentLink
from ..teardown import Teardown
from .request import ping_every
from .state import LiveState

# Seconds herd waits for every node's stacks before it stops a hung job.
EVIDENCE_TIMEOUT = 30.0
# ... and before it stops a job whose asked-for save did not come in time: shorter, since a
# time limit's stop and requeue must still fit before the scheduler's end (the dumps on
# every node run at once and take a second or two).
OVERDUE_EVIDENCE_TIMEOUT = 5.0


class AttemptActions:
    """The commands of one attempt to its nodes' agents, and the end they lead to."""

    def __init__(
        self,
        state: LiveState,
        links: dict[str, AgentLink],
        teardown: Teardown,
        output: JobOutput,
        evidence: Evidence,
        *,
        prewarm_next: bool = False,
    ) -> None:
        self.state = state
        self.links = links
        self.teardown = teardown
        self.output = output
        self.evidence = evidence
        self.prewarm_next = prewarm_next
        """Warm a wrapper for the next attempt on every node while this one stops."""
        self.over = asyncio.Event()
        """Set once every node is done with the attempt."""
        self._stacks_wanted: set[str] = set()
        self._stacks_arrived = asyncio.Event()

    # -- asked from outside (the job) --------------------------------------------------------

    def interrupt(self) -> None:
        """Ctrl-C or SIGTERM: stop every node; a second one kills every worker at once."""
        if self.state.interrupted:
            self.kill_all()
            return
        self.state.interrupted = True
        self.output.note("herd: stopping the job on every node (Ctrl-C again to kill it now)")
        self.stop_all()

    def kill_all(self) -> None:
        """Kill every worker now (no grace, no stacks); cut the links that do not confirm."""
        if self.teardown.killing:
            return
        state = self.state
        state.ending_seen()
        state.ending = True
        state.stopping = True
        self.output.verdict_given()
        self.output.note("herd: killing the job on every node")
        self.teardown.kill([h for h, node in state.nodes.items() if not node.done])

    def request_save(self, within: float, grow: str = "") -> None:
        """Ask every worker to save a snapshot and stop (torchherd.train does at its next log
        step); whatever still runs after ``within`` seconds is stopped. ``grow``: why (nodes
        came back: the next attempt has a larger world), else a time limit."""
        state = self.state
        if state.saving or state.stopping:
            return
        state.ending_seen()
        state.saving = True
        state.growing = grow
        state.save_asked_at = time.time()
        self.output.note(
            (f"herd: {grow}: " if grow else "herd: ")
            + f"asking every worker to save a snapshot and stop (stopping in {within:g} s "
            "at the latest)"
        )
        for node in state.nodes.values():
            link = self.links.get(node.host)
            if link is not None:
                link.command("save", attempt=state.number)
        asyncio.get_running_loop().call_later(within, self._save_overdue, within)

    def _save_overdue(self, within: float) -> None:
        """The time given to save is over. Where no snapshot came since the request, the
        workers are stuck somewhere (a rank waiting for a data-loader worker that never
        answers, a save that never ends): their stacks are taken before the stop, so the job
        ends with the evidence of where, not only "no snapshot came"."""
        state = self.state
        if state.ending:
            return
        if state.saved_after_request:
            self.stop_all()  # saved; what still runs after the save is only slow to exit
            return
        self.output.note(f"herd: no snapshot came within {within:g} s of the request")
        self.end_with_evidence(gather=True, timeout=OVERDUE_EVIDENCE_TIMEOUT)

    # -- stopping ----------------------------------------------------------------------------

    def stop_all(self, except_host: str | None = None, *, stacks: bool = False) -> None:
        """Stop every node (with ``stacks``, each takes its workers' stacks first)."""
        state = self.state
        state.ending_seen()
        state.ending = True
        state.stopping = True
        self.output.verdict_given()
        for host, node in state.nodes.items():
            if host != except_host:
                self.tell_stop(node, stacks=stacks)

    @property
    def attempt_to_warm(self) -> int | None:
        """The next attempt, when one may come: its wrapper is warmed as this one ends."""
        return self.state.number + 1 if self.prewarm_next else None

    def tell_stop(self, node: NodeRun, stacks: bool = False) -> None:
        if node.done:
            return
        self.teardown.stop(node.host, stacks=stacks, next_attempt=self.attempt_to_warm)

    def node_failed(self, node: NodeRun) -> None:
        """A node failed (its workers, its agent, its link): the others are stopped, since
        their workers would wait in a collective or a rendezvous that can never complete."""
        state = self.state
        if not state.ending:
            state.trigger = node.host
            state.noticed = state.noticed or (
                "its agent's link ended" if node.state == NodeState.LOST else "a worker exited"
            )
            others = "; stopping the other nodes" if len(state.nodes) > 1 else ""
            self.output.note(f"herd: {node.host} failed{others}")
            self.end_with_evidence(except_host=node.host)

    def end_with_evidence(
        self,
        except_host: str | None = None,
        *,
        gather: bool = False,
        timeout: float = EVIDENCE_TIMEOUT,
    ) -> None:
        """Stop every node after its workers' stacks are taken: each node's own before its
        stop (a failure, a lost node), or every node's before any stop (``gather``: a hang,
        where the stacks must show the job as it hung)."""
        state = self.state
        if state.ending:
            return
        state.ending_seen()
        state.ending = True
        if not gather:
            if any(not n.done and h != except_host for h, n in state.nodes.items()):
                self.output.note("herd: taking the workers' stacks as the other nodes stop")
            self.stop_all(except_host, stacks=True)
            return
        asyncio.get_running_loop().create_task(self._gather_then_stop(except_host, timeout))

    async def _gather_then_stop(self, except_host: str | None, timeout: float) -> None:
        try:
            await self.gather_stacks(timeout)
        finally:
            self.stop_all(except_host)

    def done(self, node: NodeRun) -> None:
        """The node is done with the attempt (its exit came, its link ended or was cut): its
        stop deadline is dropped, and the attempt is over once every node is done."""
        self.state.ending_seen()
        node.done = True
        self.teardown.ended(node.host)
        self.check_over()

    def check_over(self) -> None:
        if self.state.all_done():
            self.over.set()

    # -- evidence and the next attempt -------------------------------------------------------

    async def gather_stacks(self, timeout: float = EVIDENCE_TIMEOUT) -> None:
        """Ask every running agent for its workers' stacks; wait for them (at most timeout)."""
        live = self.state.running()
        self._stacks_wanted = set(live)
        if not live:
            return
        self.output.note(
            f"herd: taking the workers' stacks on {len(live)} node(s) before stopping the job"
        )
        self._stacks_arrived.clear()
        for host in live:
            link = self.links.get(host)
            if link is not None:
                link.command("stacks", attempt=self.state.number)
        try:
            await asyncio.wait_for(self._stacks_arrived.wait(), timeout)
        except TimeoutError:
            missing = ", ".join(sorted(self._stacks_wanted))
            self.evidence.problems.append(f"no stacks from {missing} within {timeout:g} s")

    def no_more_stacks_from(self, host: str) -> None:
        """The node's stacks came, or none will (its agent ended, its link is gone)."""
        self._stacks_wanted.discard(host)
        if not self._stacks_wanted:
            self._stacks_arrived.set()

    def warm_next_on(self, host: str) -> None:
        """A failed node's agent stays for the next attempt (in place): have it warm that
        attempt's wrapper now, as the other nodes do while they stop, so it does not join the
        next rendezvous last, importing torch."""
        link = self.links.get(host)
        if self.attempt_to_warm is not None and link is not None:
            link.command("prewarm", attempt=self.attempt_to_warm)

    def warm_next_everywhere(self) -> None:
        """Every node of this attempt warms the next attempt's wrapper now, while this one
        trains: a restart in place then hands its request to a wrapper that has torch
        imported already, as torchrun's own restart of its workers (which keeps its import)
        does, instead of importing torch after the stop (1-2 s of a restart). Costs each
        node an idle interpreter with torch imported while restarts are left."""
        for host in self.state.nodes:
            self.warm_next_on(host)

    async def ping_agents(self, launcher_silence: float) -> None:
        """Ping every node not done, so its agent does not take this launcher for gone."""
        while True:
            await asyncio.sleep(ping_every(launcher_silence))
            for node in self.state.nodes.values():
                link = self.links.get(node.host)
                if link is not None and not node.done:
                    link.command("ping")
