"""The first failure of an attempt: which node and rank caused the others, in words.

Timestamps alone cannot tell (torchrun records whole seconds, and peers fail within the same
second), so failures are ranked by what they are: a worker's own exit (a signal from outside
herd too: the OOM killer's SIGKILL on a node herd did not stop) before a node that was lost or
could not start, before a worker that lost a peer, before workers killed by the teardown.
Within a class the node that failed first (``trigger``: the one that made herd stop the
others) wins, then the earlier timestamp.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from ..logs import Failure
from ..plan import NodePlan

# Signals that mean "stopped because something else failed", not a cause of failure.
TEARDOWN_SIGNALS = {"SIGTERM", "SIGKILL", "SIGINT", "SIGHUP"}

# What a worker says when a peer died first: its failure is a consequence, not the cause.
PEER_LOSS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "connectFullMesh failed",
    "remote process exited",
    "NCCL communicator was aborted",
    "Socket Timeout",
    "DistNetworkError",
    "DistStoreError",
)

# Classes of failure, most likely a cause first.
_OWN, _NODE, _PEER, _TEARDOWN, _STOPPED_NODE = range(5)


@dataclass
class NodeRun:
    """One node in one attempt, as the launcher knows it.

    States:  starting -> running -> succeeded | failed | stopped | lost
             starting -> not started            (the agent could not start the attempt)
    """

    plan: NodePlan
    state: str = "starting"
    failures: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None
    stderr: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=30))
    exit_code: int | None = None
    ended_at: float | None = None
    done: bool = False
    """The attempt is over on this node: its exit came, or its link ended or was cut."""
    why_stopped: str = ""
    """The agent's word on why it stopped the attempt ("asked", "launcher-silent", ...)."""

    @property
    def host(self) -> str:
        return self.plan.host


def choose_first_failure(nodes: list[NodeRun], trigger: str | None) -> Failure | None:
    """The failure that caused the others (see the module docstring)."""
    candidates: list[tuple[int, int, float, Failure]] = []
    for node in nodes:
        host = node.plan.host
        first = 0 if host == trigger else 1
        for item in node.failures:
            stderr = tuple(item.get("last_stderr", ()))
            said = "\n".join((*stderr, str(item.get("message", ""))))
            if item.get("signal") in TEARDOWN_SIGNALS and node.state != "failed":
                kind = _TEARDOWN  # herd (or a user's stop) ended it: not a cause
            elif any(pattern in said for pattern in PEER_LOSS):
                kind = _PEER
            else:
                kind = _OWN
            failure = Failure(
                host=host,
                rank=item.get("rank"),
                exitcode=item.get("exitcode"),
                signal=item.get("signal"),
                message=first_line(item.get("message", "")),
                last_stderr=stderr,
            )
            candidates.append((kind, first, float(item.get("timestamp") or 0), failure))
        if node.error is not None and not node.failures:
            failure = Failure(
                host=host,
                rank=None,
                exitcode=None,
                signal=None,
                message=str(node.error.get("message", "")),
                last_stderr=tuple(node.error.get("last_stderr", ()))[-10:],
                remedy=str(node.error.get("remedy", "")),
            )
            kind = _STOPPED_NODE if node.state == "stopped" else _NODE
            candidates.append((kind, first, node.ended_at or float("inf"), failure))
    if not candidates:
        return None
    return min(candidates, key=lambda c: c[:3])[3]


def first_line(text: str) -> str:
    text = text.strip()
    if "To enable traceback" in text:
        return ""
    return text.splitlines()[0] if text else ""
