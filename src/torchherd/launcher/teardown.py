"""How an attempt's nodes are stopped: told, given their time, cut off, swept.

A node told to stop gets the grace period plus its agent's own teardown budget (the stacks of
what still runs, SIGKILL, the sweep: agent.attempt.TEARDOWN_BUDGET) and a margin; a node told
to die (a second Ctrl-C) gets KILL_WAIT. One whose agent has not reported the attempt's end by
then is cut off (its session killed) and swept through a session of its own (sweeps.py), and
only a confirmed sweep lets a later attempt use the node.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ..agent.attempt import ATTEMPT_VAR, TEARDOWN_BUDGET
from ..logs import JobOutput
from ..plan import LaunchPlan, NodePlan
from ..spec import ClusterSpec
from ..transport import Transport
from .links import AgentLink
from .sweeps import SWEEP_MARGIN, sweep_attempt

# Seconds beyond the grace period and the agent's own teardown budget before a stopping
# node's link is cut.
STOP_MARGIN = 5.0
# Seconds a second Ctrl-C waits for the agents to kill their workers before cutting them off.
KILL_WAIT = 5.0


class Teardown:
    """The stop of one attempt's nodes: deadlines, cut-offs and sweeps."""

    def __init__(
        self,
        plan: LaunchPlan,
        cluster: ClusterSpec,
        transport: Transport,
        links: dict[str, AgentLink],
        output: JobOutput,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plan = plan
        self.cluster = cluster
        self.transport = transport
        self.links = links
        self.output = output
        self.clock = clock
        self.killing = False
        self.number = int(plan.nodes[0].env.get(ATTEMPT_VAR, "0")) if plan.nodes else 0
        """The attempt these nodes run: the agents act on its commands only."""
        self.deadlines: dict[str, float] = {}
        self.sweeps: dict[str, asyncio.Task[bool]] = {}

    def told(self, host: str) -> bool:
        return host in self.deadlines

    def stop(self, host: str, *, stacks: bool = False, next_attempt: int | None = None) -> None:
        """Tell a node's agent to end the attempt (its stacks first, with ``stacks``; warm a
        wrapper for ``next_attempt`` meanwhile)."""
        link = self.links.get(host)
        if link is None or host in self.deadlines:
            return
        fields: dict[str, object] = {"stacks": stacks, "attempt": self.number}
        if next_attempt is not None:
            fields["next"] = next_attempt
        link.command("stop", **fields)
        self.deadlines[host] = self.clock() + self.plan.grace + TEARDOWN_BUDGET + STOP_MARGIN

    def kill(self, hosts: list[str]) -> None:
        """Tell these nodes' agents to kill their workers now (no grace, no stacks)."""
        self.killing = True
        deadline = self.clock() + KILL_WAIT
        for host in hosts:
            link = self.links.get(host)
            if link is not None:
                link.command("kill", attempt=self.number)
                self.deadlines[host] = min(self.deadlines.get(host, deadline), deadline)

    def ended(self, host: str) -> None:
        """The node's agent reported the attempt's end (or its link ended)."""
        self.deadlines.pop(host, None)

    def excuse(self, seconds: float) -> None:
        """This launcher did not run for ``seconds``: the nodes get that time back."""
        for host in self.deadlines:
            self.deadlines[host] += seconds

    def cut_overdue(self) -> None:
        """Cut off the nodes whose agents have not ended the attempt in time."""
        now = self.clock()
        for host, deadline in list(self.deadlines.items()):
            if now <= deadline:
                continue
            del self.deadlines[host]
            link = self.links.get(host)
            if link is None or not link.alive:
                continue
            waited = (
                "the kill"
                if self.killing
                else f"the stop (grace {self.plan.grace:g} s + the agent's teardown "
                f"{TEARDOWN_BUDGET:g} s)"
            )
            self.output.note(
                f"herd: {host}'s agent had not ended its share after {waited}; cutting it off "
                "and sweeping what it left"
            )
            link.cut()

    def sweep_later(self, node: NodePlan) -> None:
        """Sweep the attempt on a node whose agent is gone or cut off (once)."""
        if node.host not in self.sweeps:
            self.sweeps[node.host] = asyncio.create_task(self._sweep(node))

    async def _sweep(self, node: NodePlan) -> bool:
        swept = await sweep_attempt(
            self.transport,
            self.cluster,
            self.plan.job_id,
            node,
            grace=0 if self.killing else self.plan.grace,
        )
        if swept.error is not None:
            self.output.note(f"herd: could not sweep {node.host}: {swept.error}")
        elif swept.processes:
            self.output.note(
                f"herd: ended {swept.processes} process(es) of the attempt left on {node.host}"
            )
        return swept.confirmed

    async def finish_sweeps(self) -> None:
        if self.sweeps:
            await asyncio.wait(self.sweeps.values(), timeout=self.plan.grace + SWEEP_MARGIN + 5)

    def unconfirmed(self) -> tuple[str, ...]:
        """Nodes whose sweep did not confirm the attempt ended there."""
        return tuple(
            host
            for host, task in self.sweeps.items()
            if not (task.done() and not task.cancelled() and task.result())
        )
