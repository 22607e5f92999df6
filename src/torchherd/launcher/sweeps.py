"""Attempt-scoped sweeps: end what one attempt left on a node, through a session of its own.

When a node's agent is gone (killed, its link cut) the launcher cannot ask it to stop; the
node's `stop` verb then ends that attempt's agent and processes, found by job id and attempt
number (never by name, never another attempt's), and says whether anything survived. No new
attempt starts on a node whose last attempt was not confirmed ended this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..agent.protocol import ATTEMPT_VAR
from ..plan import NodePlan
from ..spec import ClusterSpec
from ..transport import Transport

# Seconds beyond the grace period a sweep of a node may take.
SWEEP_MARGIN = 15.0


@dataclass(frozen=True)
class Swept:
    """What an attempt-scoped stop on a node found and did."""

    confirmed: bool
    """Nothing of the attempt is left there (and its agent, if any, has exited)."""
    processes: int = 0
    error: str | None = None


async def sweep_attempt(
    transport: Transport,
    cluster: ClusterSpec,
    job_id: str,
    node: NodePlan,
    *,
    grace: float,
    timeout: float | None = None,
) -> Swept:
    """End one attempt's agent and processes on a node (the `stop` verb, by job id and the
    attempt of ``node``'s plan), through a session of its own."""
    from ..transport.agent_call import call_agent

    request: dict[str, Any] = {
        "job_id": job_id,
        "node": node.name,
        "grace": grace,
        "attempt": node.env.get(ATTEMPT_VAR),
    }
    if node.env.get("HERD_HOME"):
        request["herd_home"] = node.env["HERD_HOME"]
    answer = await call_agent(
        transport,
        cluster.node(node.host),
        "stop",
        request,
        timeout=timeout or grace + SWEEP_MARGIN,
    )
    if not answer.ok or answer.data is None:
        return Swept(False, error=answer.error)
    data = answer.data
    confirmed = not data.get("survivors") and not data.get("agent_left")
    return Swept(confirmed, int(data.get("processes") or 0))
