"""Hang detection: a job whose ranks make no progress for longer than a limit is hung.

Progress signals are each rank's output lines and the step beats a script sends with
``torchherd.progress.beat(step)`` (the Trainer does every step). Lines of torchrun itself
(no rank) do not count.

Nothing is judged before the first progress signal: start-up (importing torch, the
rendezvous, loading data) has its own timeouts in torchrun. After it, the limit is either
fixed (``--hang-timeout S``; 0 turns the watch off) or learned from the job (the default):

- signals less than ``BEAT_GAP`` seconds apart count as one (a burst of lines is one sign);
- the watch arms once it has seen ``ARM_AFTER`` such signs, that is, once the job has shown
  its rhythm; until then nothing is judged (start-up, data loading, compiling);
- the limit is ``max(FLOOR, FACTOR x the longest gap seen between signs)``, so it only grows:
  a script that prints once an hour gets a limit of three hours after its second hour.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# Seconds: a hang is never called sooner once the watch is armed (herd's target: a hang seen
# within a minute).
FLOOR = 50.0
FACTOR = 3.0
BEAT_GAP = 1.0
ARM_AFTER = 3


@dataclass(frozen=True)
class Hang:
    """A detected hang: how long nothing moved, against which limit and why that limit."""

    silent_for: float
    limit: float
    how: str

    def describe(self) -> str:
        return (
            f"no progress from any rank for {self.silent_for:.0f} s (limit {self.limit:.0f} s, "
            f"{self.how})"
        )


class HangWatch:
    """Progress signals in; ``check()`` says whether the job is hung."""

    def __init__(
        self,
        timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        floor: float = FLOOR,
        factor: float = FACTOR,
    ) -> None:
        """``timeout``: None learns the limit, 0 turns the watch off, S > 0 is a fixed limit."""
        self.timeout = timeout
        self.floor = floor
        self.factor = factor
        self._clock = clock
        self._last: float | None = None
        self._last_sign: float | None = None
        self._signs = 0
        self._longest_gap = 0.0
        self.steps: dict[int, int] = {}
        """The highest step each rank reported."""
        self.last_signal: dict[int, float] = {}
        """When each rank last showed progress (clock time)."""

    def signal(self, rank: int | None, step: int | None = None) -> None:
        """A rank showed progress (an output line, or a beat at ``step``)."""
        if rank is None:
            return
        now = self._clock()
        self._last = now
        self.last_signal[rank] = now
        if step is not None and step >= self.steps.get(rank, -1):
            self.steps[rank] = step
        if self._last_sign is None or now - self._last_sign >= BEAT_GAP:
            if self._last_sign is not None:
                self._longest_gap = max(self._longest_gap, now - self._last_sign)
            self._last_sign = now
            self._signs += 1

    @property
    def max_step(self) -> int | None:
        return max(self.steps.values()) if self.steps else None

    def limit(self) -> tuple[float, str] | None:
        """The limit in force and how it was set; None while nothing is judged."""
        if self.timeout == 0:
            return None
        if self.timeout is not None:
            return self.timeout, "set by --hang-timeout"
        if self._signs < ARM_AFTER:
            return None
        learned = self.factor * self._longest_gap
        if learned > self.floor:
            return learned, f"{self.factor:g} x the longest gap seen, {self._longest_gap:.0f} s"
        gap = self._longest_gap
        return self.floor, f"the {self.floor:.0f} s floor; longest gap seen {gap:.1f} s"

    def check(self) -> Hang | None:
        """The hang, if the job has been silent for longer than the limit."""
        limit = self.limit()
        if limit is None or self._last is None:
            return None
        silent = self._clock() - self._last
        return Hang(silent, limit[0], limit[1]) if silent > limit[0] else None
