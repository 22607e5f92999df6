"""Calling node agent verbs (stop, status, logs, top) over a transport, and what goes wrong.

Every verb takes one JSON request on stdin and answers JSON, so the secrets-free request never
touches a command line and the answer is parsed, never scraped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..spec import ClusterSpec, NodeSpec
from . import CommandResult, Transport


@dataclass(frozen=True)
class AgentAnswer:
    """One node's answer to a verb: the JSON it printed, or why there is none."""

    host: str
    data: dict[str, Any] | None
    error: str | None = None
    """Why the node did not answer, with the fix; None when it did."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.data is not None


def agent_argv(cluster: ClusterSpec, node: NodeSpec, verb: str) -> list[str]:
    return [cluster.python_for(node), "-m", "torchherd.agent", verb]


async def call_agent(
    transport: Transport,
    node: NodeSpec,
    verb: str,
    request: dict[str, Any],
    *,
    timeout: float = 60,
) -> AgentAnswer:
    """Run ``python -m torchherd.agent VERB`` on a node with the request on stdin."""
    result = await transport.run(
        node,
        agent_argv(transport.cluster, node, verb),
        input=json.dumps(request).encode() + b"\n",
        timeout=timeout,
    )
    if not result.ok:
        return AgentAnswer(node.host, None, explain_failure(transport.cluster, node, result))
    for line in reversed(result.stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            return AgentAnswer(node.host, data)
    return AgentAnswer(node.host, None, f"{node.host}: the agent answered with no JSON")


def explain_failure(cluster: ClusterSpec, node: NodeSpec, result: CommandResult) -> str:
    """One line, host first, saying why an agent verb failed there and what to do."""
    if result.unreachable is not None:
        return f"{result.unreachable.describe()}; fix: {result.unreachable.remedy}"
    if result.timed_out:
        return f"{node.host}: no answer in time; fix: check the node's load (`herd exec -- uptime`)"
    stderr = result.stderr.strip()
    python = cluster.python_for(node)
    if "No module named torchherd" in stderr:
        return (
            f"{node.host}: torchherd is not installed for {python}; fix: "
            "`herd exec -- python3 -m pip install torchherd`"
        )
    if result.returncode == 127:
        return f"{node.host}: {python} not found; fix: set python in herd.toml"
    last = stderr.splitlines()[-1] if stderr else f"exit code {result.returncode}"
    return f"{node.host}: the agent failed: {last}"
