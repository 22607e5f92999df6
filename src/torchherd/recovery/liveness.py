"""Node liveness as the launcher sees it, and the launcher's own stalls.

Agents say {"e": "alive"} every 2 s besides their output, for as long as they run (stopping
included), so a node that says nothing for ``silence`` seconds has lost its link or its
machine. ssh would notice later (ServerAlive: 15 s and more) and only as "ssh failed"; herd
says when the node stopped answering and what it means.

Silence is only evidence when the launcher itself was there to hear. A launcher that was
stopped (Ctrl-Z, SIGSTOP), suspended (a laptop lid), starved or blocked hears nothing from
anyone, and on its return finds every node "silent" with their events still waiting in the
pipes. ``LauncherClock`` notices such a gap (on CLOCK_BOOTTIME, which runs through a suspend),
and ``NodeLiveness.excuse`` starts every node's silence afresh: a stalled launcher never
blames the nodes.

A quiet link is not a lost node while the job visibly goes on with it (``steps_vouch_for``):
when the other nodes' ranks step well after the node's last word, its ranks take part in
their collectives (its control link is the trouble, not its machine); it is then given up to
launcher_silence before it is called lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

# Seconds without a word from a node's agent before herd calls the node lost.
SILENCE = 10.0
# Seconds the launcher's watch may wake up late before herd calls it a stall of its own.
STALL = 3.0


def boot_clock() -> float:
    """Seconds since boot, suspend included (Linux); monotonic time elsewhere."""
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):
        return time.monotonic()


class LauncherClock:
    """Measures how long this process did not run between two ticks of a periodic watch."""

    def __init__(self, every: float, clock: Callable[[], float] = boot_clock) -> None:
        self.every = every
        self._clock = clock
        self._last = clock()

    def tick(self) -> float:
        """Seconds this tick came later than expected (0 when on time, within STALL)."""
        now = self._clock()
        late = now - self._last - self.every
        self._last = now
        return late if late > STALL else 0.0


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

    def excuse(self) -> None:
        """The launcher did not run for a while: every node's silence starts again now
        (what they said meanwhile is still in the pipes and comes next)."""
        now = self._clock()
        for host in self._heard:
            self._heard[host] = now

    def silent(self) -> list[str]:
        """Watched nodes not heard from for longer than ``silence``."""
        now = self._clock()
        return [h for h in sorted(self._watching) if now - self._heard[h] > self.silence]

    def last_heard(self, host: str) -> float:
        """When (on this watch's clock) the node was last heard from."""
        return self._heard[host]

    def last_heard_wall(self, host: str) -> float:
        """Wall-clock time the node was last heard from (for "stopped answering at ...")."""
        return self._wall_heard[host]


# Seconds after a quiet node's last word by which the others' steps show that its ranks still
# take part in the collectives (not a step that was in flight, not a late beat)...
QUIET_STEP_MARGIN = 5.0
# ... or this share of the link's silence limit, when less: the proof must be able to come
# before the node is called lost (a link_silence of 4 s leaves 1.6 s for it; beats come
# every second).
QUIET_STEP_SHARE = 0.6


def steps_vouch_for(
    heard: float, others_stepped: Iterable[float], now: float, silence: float, limit: float
) -> bool:
    """Whether a node quiet since ``heard`` is still in the job for all that: the other nodes'
    ranks stepped well after its last word and lately (``others_stepped``: when each other
    node's step last went up), so its ranks take part in their collectives; never past
    ``limit`` seconds of quiet."""
    if now - heard > limit:
        return False
    margin = min(QUIET_STEP_MARGIN, QUIET_STEP_SHARE * silence)
    return any(t > heard + margin and now - t < silence for t in others_stepped)
