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
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..plan import NodePlan
from ..results import Failure
from .causes import Cause, explain

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


class NodeState(StrEnum):
    """Where one node stands in one attempt (strings, so records and JSON read as before).

    starting -> running -> succeeded | failed | stopped | lost
    starting -> not started            (the agent could not start the attempt)
    """

    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"
    NOT_STARTED = "not started"


@dataclass
class NodeRun:
    """One node in one attempt, as the launcher knows it (its state: NodeState)."""

    plan: NodePlan
    state: NodeState = NodeState.STARTING
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
            if item.get("signal") in TEARDOWN_SIGNALS and node.state != NodeState.FAILED:
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
            kind = _STOPPED_NODE if node.state == NodeState.STOPPED else _NODE
            candidates.append((kind, first, node.ended_at or float("inf"), failure))
    if not candidates:
        return None
    return min(candidates, key=lambda c: c[:3])[3]


def first_line(text: str) -> str:
    text = text.strip()
    if "To enable traceback" in text:
        return ""
    return text.splitlines()[0] if text else ""


# A worker SIGKILLed on a node herd was not stopping: not herd's doing.
OUTSIDE_KILL = Cause(
    "killed-from-outside",
    "the worker was killed by SIGKILL from outside herd: most often the kernel's "
    "out-of-memory killer, else a person or another program",
    "look for 'Out of memory: Killed process' in `dmesg` or `journalctl -k` on that node; "
    "give each worker less host memory (a smaller batch, fewer DataLoader workers)",
)


def in_words(
    failure: Failure,
    nodes: list[NodeRun],
    plans: Sequence[NodePlan],
    ranks_seen: Iterable[tuple[str, int]],
) -> Failure:
    """The failure with its cause and fix in words when its signature is known
    (recovery.causes), naming the nodes that never joined a timed-out rendezvous, or the
    peer a reset connection points at."""
    text = "\n".join((failure.message, *failure.last_stderr))
    found = explain(text)
    if found is None and failure.signal == "SIGKILL" and failure.rank is not None:
        found = OUTSIDE_KILL
    if found is None or failure.cause:
        return failure
    cause = found.cause
    if found.kind == "rendezvous-timeout":
        absent = never_joined(nodes, ranks_seen)
        if absent:
            cause += f"; never joined: {', '.join(absent)}"
    elif found.kind == "peer-connection":
        peer = peer_named_in(text, plans)
        if peer is not None:
            cause += f"; the peer is {peer}"
    return Failure(
        failure.host,
        failure.rank,
        failure.exitcode,
        failure.signal,
        failure.message,
        failure.last_stderr,
        remedy=failure.remedy or found.fix,
        cause=cause,
    )


def never_joined(nodes: list[NodeRun], ranks_seen: Iterable[tuple[str, int]]) -> list[str]:
    """Nodes whose workers never started in the attempt (no rank spoke there) and that did not
    time out waiting in the rendezvous themselves: the ones the others waited for."""
    spoke = {host for host, _ in ranks_seen}
    waited = {
        node.host
        for node in nodes
        if node.error
        and "Rendezvous" in f"{node.error.get('error', '')} {node.error.get('message', '')}"
    }
    return [node.host for node in nodes if node.host not in spoke and node.host not in waited]


def peer_named_in(text: str, plans: Sequence[NodePlan]) -> str | None:
    """The node whose address a connection error names."""
    for node in plans:
        if node.local_addr and re.search(rf"\b{re.escape(node.local_addr)}\b", text):
            return node.host
    return None


def first_named(behind: Iterable[str]) -> tuple[str, int] | None:
    """(host, rank) of the first "host rank R: ..." line."""
    for line in behind:
        match = re.match(r"(\S+) rank (\d+):", line)
        if match:
            return match.group(1), int(match.group(2))
    return None
