"""What an agent is asked to run an attempt from, and how often the launcher pings it.

One request per node (``agent_request``): the node's argv and environment from the plan, plus
the agent's side of supervision (how often it says "alive", how long it waits for a silent
launcher, how often it reports progress, which worker lines it sends). `herd launch --detach`
sends the same request, so both paths start the same agent run.
"""

from __future__ import annotations

from typing import Any

from ...plan import LaunchPlan, NodePlan

# Seconds between pings to each agent: at least this often, and often enough that an agent
# hears the launcher PINGS_PER_SILENCE times within its launcher_silence (at most this rarely).
HEARTBEAT_INTERVAL = 2.0
PINGS_PER_SILENCE = 9
LONGEST_PING_GAP = 10.0
# Above this many nodes a job is large: the agents send the console only rank 0's lines and
# every rank's stderr (every line is kept on its node: herd logs JOB --rank R fetches it
# there), and each reports its ranks' progress every LARGE_JOB_REPORT_EVERY s, not every
# second: a report is one event, and events are the launcher's steady work per node.
LARGE_JOB_NODES = 16
LARGE_JOB_REPORT_EVERY = 3.0
# Seconds of silence from the launcher after which an agent ends its attempt (by default;
# [cluster] launcher_silence): a launcher that was stopped, suspended or blocked for up to a
# minute finds its job still running.
AGENT_SILENCE = 90.0


def agent_request(
    plan: LaunchPlan,
    node: NodePlan,
    silence: float = AGENT_SILENCE,
    send: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The request an agent runs an attempt from; `herd launch --detach` sends it too.
    ``silence``: seconds without a word from the launcher before the agent stops the job;
    ``send``: which worker lines to send (None: all; else ``{"ranks": [...], "stderr": bool}``,
    the rest kept on the node)."""
    request: dict[str, Any] = {
        "job_id": plan.job_id,
        "node": node.name,
        "workdir": plan.workdir,
        "argv": list(node.argv),
        "env": dict(node.env),
        "secret_env": dict(plan.secret_env),
        "grace": plan.grace,
        "heartbeat": HEARTBEAT_INTERVAL,
        "silence": silence,
        "report_every": LARGE_JOB_REPORT_EVERY if len(plan.nodes) > LARGE_JOB_NODES else 1.0,
        "serve": True,  # the agent stays for the job's next attempt (a restart in place)
    }
    if send is not None:
        request["send"] = send
    return request


def ping_every(launcher_silence: float) -> float:
    """Seconds between the launcher's pings to each agent. Pings only keep an agent from
    taking the launcher for gone (its launcher_silence, 90 s by default): on a large job a ping
    every 2 s to every node would be most of the launcher's steady work."""
    return min(max(HEARTBEAT_INTERVAL, launcher_silence / PINGS_PER_SILENCE), LONGEST_PING_GAP)
