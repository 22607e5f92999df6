"""A node's step time over a run, kept small enough for the job record (standard library only:
the launcher keeps one series per node and attempt, the node agent reads the same measure for
`herd top`).

What a node's "step time" is: in a synchronous job every rank's step takes the same wall time
(each all-reduce waits for the slowest), so wall time per step hides the slow node. What differs
is the work: the step less the time the rank was blocked on the others (the Trainer's ``cycle``
less its ``wait``), else its own forward passes (``compute``, on a GPU). A node's value is its
slowest rank's. A script that beats only its step gets seconds per step from its step count
(``wall``): the same on every node, but a slowdown of the whole job still shows.

The series is bounded: points are windows of ``per_point`` beat reports (about a second each),
at most ``limit`` of them; when full, neighbours merge pairwise and windows double, so an hour's
run keeps the same shape as a minute's, and the newest window, even half filled, is never
dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Points a node keeps per attempt: a few kilobytes of JSON per node in the job record; on a
# large job fewer, so that an attempt's step times stay within BUDGET points (about 1.5 MB of
# a record that is rewritten whole), but never fewer than FEWEST.
LIMIT = 240
BUDGET = 48_000
FEWEST = 24
WORK, COMPUTE, WALL = "work", "compute", "wall"


def beat_seconds(compute: object, wait: object, cycle: object) -> tuple[float, str] | None:
    """(seconds of a rank's own work per step, what they measure) from one beat's timings;
    None when the beat carries none."""
    if isinstance(cycle, int | float) and isinstance(wait, int | float):
        return max(0.0, float(cycle) - float(wait)), WORK
    if isinstance(compute, int | float):
        return float(compute), COMPUTE
    return None


def limit_for(nodes: int) -> int:
    """Points per node for a job on ``nodes`` nodes."""
    return max(FEWEST, min(LIMIT, BUDGET // max(nodes, 1)))


@dataclass
class _Window:
    step: int
    at: float
    total: float = 0.0
    count: int = 0

    def point(self) -> list[float]:
        return [self.step, round(self.total / self.count, 6), round(self.at, 2)]


@dataclass
class StepSeries:
    """One node's step times in one attempt: ``add`` a value per beat report, ``points()``
    for the record, [[step, seconds, at], ...] (``at`` on this launcher's clock, the end of
    the point's window; ``seconds`` the window's mean)."""

    limit: int = LIMIT
    per_point: int = 1
    """Reports merged into one point (doubles each time the series fills)."""
    measure: str | None = None
    """WORK, COMPUTE or WALL: what the seconds are (a node that reports timings once is
    measured by them from then on; its wall points before are dropped, never mixed in)."""
    windows: list[_Window] = field(default_factory=list)
    _last: tuple[int, float] | None = None
    """The node's (step, beat time) at its previous report, for WALL."""

    def add(self, step: object, at: object, now: float, timed: tuple[float, str] | None) -> None:
        """One report of the node: its newest step, the beat's time (the node's clock, for
        steps per second), this launcher's clock, and its work per step when its beats time
        it (``beat_seconds``)."""
        if not isinstance(step, int) or not isinstance(at, int | float):
            return
        last = self._last
        if last is None or step != last[0]:  # the time its step went up, not a later beat's
            self._last = (step, float(at))
        if timed is not None:
            seconds, measure = timed
            if self.measure == WALL:
                self.windows.clear()
        elif self.measure in (None, WALL) and last is not None and step > last[0]:
            seconds, measure = (float(at) - last[1]) / (step - last[0]), WALL
        else:
            return
        self.measure = measure
        if len(self.windows) >= self.limit and self.windows[-1].count >= self.per_point:
            self._halve()
        if self.windows and self.windows[-1].count < self.per_point:
            window = self.windows[-1]  # room in the newest (an odd one out of a halving too)
        else:
            window = _Window(step, now)
            self.windows.append(window)
        window.step, window.at = step, now
        window.total += seconds
        window.count += 1

    def _halve(self) -> None:
        """Merge neighbours pairwise: half the points, each over twice the reports."""
        merged = []
        for i in range(0, len(self.windows), 2):
            pair = self.windows[i : i + 2]
            last = pair[-1]
            merged.append(
                _Window(last.step, last.at, sum(w.total for w in pair), sum(w.count for w in pair))
            )
        self.windows = merged
        self.per_point *= 2

    def points(self) -> list[list[float]]:
        return [w.point() for w in self.windows if w.count]
