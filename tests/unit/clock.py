"""A test clock: time that moves only when a test says so (recovery's watches take a clock)."""

from __future__ import annotations


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
