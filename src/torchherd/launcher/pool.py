"""The nodes a job may turn to beyond its current attempt's: hot spares, and nodes it went on
without until they come back.

    spares     checked with the others at launch, their agents open and a wrapper warm for
               the next attempt, pinged while they wait (an idle agent answers); one silent
               for IDLE_SILENCE s is dropped, so a dead spare is never chosen
    left out   nodes the job went on without (lost, or set aside for failing attempts in a
               row); every GROW_PROBE_EVERY seconds each is swept (its last attempt's agent and
               processes ended, which tells too whether it answers), probed and checked
               against the job's nodes with a launch's checks (torch, versions held to the
               job's nodes, the workdir, the script, and no fewer GPUs than it had); a node
               left out again waits longer each time first (recovery.policy.comeback_delay)
    returned   left-out nodes that passed: warm like spares, ready to join at the next
               snapshot boundary (or the next restart), or to stand by as spares once the
               world is full again

The choice itself is the restart decision's (recovery.policy, through recovery.nodes); this
module only keeps the nodes ready, and admits a node back (``joining_problems``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ..facts import NodeFacts
from ..plan import JobSpec, NodePlan
from ..recovery.liveness import SILENCE
from ..recovery.policy import comeback_delay
from ..spec import ClusterSpec
from ..transport import Transport
from .links import AgentLink
from .prepare import fast_preflight, open_links, probe_node
from .sweeps import sweep_attempt

# Seconds between looks at the nodes the job went on without.
GROW_PROBE_EVERY = 15.0
# Seconds between pings to idle agents (spares, returned nodes).
PING_EVERY = 2.0
# Seconds without a word after which an idle agent that answers pings is taken for gone.
IDLE_SILENCE = SILENCE


class NodePool:
    """Idle spares, left-out nodes and returned nodes of one job, kept ready."""

    def __init__(
        self,
        cluster: ClusterSpec,
        transport: Transport,
        links: dict[str, AgentLink],
        facts: dict[str, NodeFacts],
        say: Callable[[str], None],
    ) -> None:
        self.cluster = cluster
        self.transport = transport
        self.links = links
        """The job's links (shared with the job): spares and returned nodes keep theirs here."""
        self.facts = facts
        self.say = say
        self.spares: list[str] = [n.host for n in cluster.spares if n.host in links]
        """Idle spares, their agents warm."""
        self.left_out: dict[str, NodePlan] = {}
        """Nodes the job went on without, with their last attempt's plan (to sweep it)."""
        self.returned: list[str] = []
        """Left-out nodes that answer again, swept and checked, their agents warm."""
        self.times_out: dict[str, int] = {}
        """How many times each node was left out (a flapping node waits longer each time)."""
        self.not_before: dict[str, float] = {}
        """When a left-out node may next be looked at (time.monotonic())."""

    def idle(self) -> list[str]:
        return [*self.spares, *self.returned]

    def warm(self, attempt: int) -> None:
        """Have every idle agent warm a wrapper for ``attempt`` (the one it may join)."""
        for host in self.idle():
            link = self.links.get(host)
            if link is not None:
                link.command("prewarm", attempt=attempt)

    def leave_out(
        self, hosts: tuple[str, ...], plans: dict[str, NodePlan], set_aside: tuple[str, ...] = ()
    ) -> None:
        """The job goes on without these nodes; a node left out before (or set aside for
        failing, which counts as twice) waits comeback_delay() before it is looked at."""
        for host in hosts:
            self.left_out[host] = plans[host]
            self.links.pop(host, None)
            times = self.times_out.get(host, 0) + (2 if host in set_aside else 1)
            self.times_out[host] = times
            delay = comeback_delay(times)
            self.not_before[host] = time.monotonic() + delay
            if delay:
                self.say(
                    f"herd: {host} left out {times} time(s): it is looked at again in "
                    f"{delay:.0f} s at the earliest"
                )

    def answering(self, host: str) -> bool:
        """An idle node's agent is there and, if it answers pings, answered lately."""
        link = self.links.get(host)
        if link is None or not link.alive:
            return False
        limit = max(IDLE_SILENCE, self.cluster.link_silence)
        return not (link.answers_pings and link.silent_for() > limit)

    def take(self, hosts: tuple[str, ...]) -> None:
        """These idle nodes join the next attempt."""
        self.spares = [h for h in self.spares if h not in hosts]
        self.returned = [h for h in self.returned if h not in hosts]

    def stand_by(self, hosts: list[str]) -> None:
        """Returned nodes the full world has no room for become spares."""
        for host in hosts:
            if host in self.returned:
                self.returned.remove(host)
                self.spares.append(host)

    async def tend(self, job: JobSpec, members: Callable[[], list[str]]) -> None:
        """While an attempt runs: ping idle agents (forgetting those whose link ended), and
        look at left-out nodes every GROW_PROBE_EVERY s. ``members``: the attempt's nodes."""
        since_probe = 0.0
        while True:
            await asyncio.sleep(PING_EVERY)
            for host in self.idle():
                link = self.links.get(host)
                if link is None or not self.answering(host):
                    kind = "spare " if host in self.spares else ""
                    self.spares = [h for h in self.spares if h != host]
                    self.returned = [h for h in self.returned if h != host]
                    self.links.pop(host, None)
                    if link is not None:
                        # Closed, not killed: a session cut here leaves the node's sshd to
                        # learn of it only from a late retransmission once the node is back.
                        link.close()
                    self.say(f"herd: {kind}{host} stopped answering; it is no longer kept ready")
                else:
                    link.command("ping")
            since_probe += PING_EVERY
            if self.left_out and since_probe >= GROW_PROBE_EVERY:
                since_probe = 0.0
                now = time.monotonic()
                for host in list(self.left_out):
                    if self.not_before.get(host, 0.0) > now:
                        continue
                    if await self.bring_back(host, job, members()):
                        self.say(f"herd: {host} answers again; it was swept and checked")

    async def bring_back(self, host: str, job: JobSpec, members: list[str]) -> bool:
        """Sweep what the node's last attempt left, probe it, check it against the job's
        nodes, open its agent (warm): True once it is ready to join."""
        plan = self.left_out[host]
        cluster = self.cluster
        swept = await sweep_attempt(
            self.transport,
            cluster,
            job.job_id,
            plan,
            grace=0,
            timeout=cluster.connect_timeout + 10,
        )
        if not swept.confirmed:
            return False
        node = cluster.node(host)
        facts = await probe_node(
            cluster, self.transport, node, cluster.workdir, entry=job.entry_request()
        )
        if not isinstance(facts, NodeFacts):
            return False
        problems = joining_problems(cluster, self.facts, members, host, facts)
        if problems:
            self.say(f"herd: {host} answers again but cannot join: {problems[0]}")
            return False
        opened = await open_links(cluster, self.transport, job, [node])
        if host not in opened:
            return False
        self.facts[host] = facts
        self.links[host] = opened[host]
        opened[host].start_reading()
        del self.left_out[host]
        self.returned.append(host)
        return True


def joining_problems(
    cluster: ClusterSpec,
    known: dict[str, NodeFacts],
    members: list[str],
    host: str,
    facts: NodeFacts,
) -> list[str]:
    """Why ``host`` (probed again: ``facts``) may not join the job running on ``members``:
    a launch's checks, its versions held to the members' (never the other way round, on a tie
    too), and no fewer GPUs than it had when the job knew it. Empty: it may join."""
    checked = {**known, host: facts}
    together = cluster.select([*members, host])
    problems = [p for p in fast_preflight(together, checked, joining=(host,)) if p.startswith(host)]
    before = known.get(host)
    if before is not None and facts.gpu_count < before.gpu_count:
        problems.append(
            f"{host}: {facts.gpu_count} GPU(s) now, {before.gpu_count} when the job started; "
            "fix: look at the node's GPUs (nvidia-smi), or leave it out of the cluster"
        )
    return problems
