"""Node liveness as the launcher sees it: every event from a node's agent is a sign of life.

Agents say {"e": "alive"} every 2 s besides their output, so a node that says nothing for
``silence`` seconds has lost its link or its machine. ssh would notice later (ServerAlive: 15 s
and more) and only as "ssh failed"; herd says when the node stopped answering and what it means.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

# Seconds without a word from a node's agent before herd calls the node lost.
SILENCE = 10.0


class NodeLiveness:
    """When each node was last heard from; which ones have been silent too long."""

    def __init__(
        self,
        hosts: Iterable[str],
        silence: float = SILENCE,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.silence = silence
        self._clock = clock
        self._wall = wall
        now = clock()
        self._heard = {host: now for host in hosts}
        self._wall_heard = {host: wall() for host in hosts}
        self._watching: set[str] = set()

    def watch(self, host: str) -> None:
        """Start judging ``host`` (once its agent runs: connecting takes its own time)."""
        self.heard(host)
        self._watching.add(host)

    def forget(self, host: str) -> None:
        """Stop judging ``host`` (its agent ended, or it was already declared lost)."""
        self._watching.discard(host)

    def heard(self, host: str) -> None:
        self._heard[host] = self._clock()
        self._wall_heard[host] = self._wall()

    def silent(self) -> list[str]:
        """Watched nodes not heard from for longer than ``silence``."""
        now = self._clock()
        return [h for h in sorted(self._watching) if now - self._heard[h] > self.silence]

    def last_heard_wall(self, host: str) -> float:
        """Wall-clock time the node was last heard from (for "stopped answering at ...")."""
        return self._wall_heard[host]
