"""Slow ranks, named while the job runs: the rank that holds the others back.

A step's wall time is the same on every rank (each collective waits for the slowest), so a
slow rank hides in the others' waiting. herd sees it three ways, with no change to the script:

    waiting   the Trainer of torchherd.train on a CPU beats each step with the seconds the
              rank was blocked on the others (the gradients' all-reduce after its own
              backward was done) and the seconds of the whole step (train._timing.WaitTimer).
              The rank everyone waits for waits least, wherever in the step its slowness
              lands. Over the last WAIT_WINDOW beats of each rank (its first WARMUP beats of
              an attempt left out, no step after an evaluation or a snapshot, means without
              the highest and lowest tenth), the rank that waited least, while the others'
              median wait is at least MIN_GAP more and its work (step minus wait) at least
              LAG x theirs, in CONFIRM_WAIT checks in a row, is slow ("1.22x slower than the
              median rank: the others wait 31 ms of every 186 ms step for it"); if it also
              waited for its data loader for at least a third of that lag more than the
              others did, its data loader is named as the likely cause (a third, not all:
              a slow loader's worker also takes CPU from its own rank's step, so the
              rank's extra wait for batches is only part of what its loader costs it)
    compute   on a GPU, the Trainer beats each step with the seconds the rank spent
              on its own forward passes (``progress.beat(step, compute=...)``; each beat herd
              reads is the mean of the steps since the one before): a rank whose
              typical time over its last WINDOW beats (a mean without the slowest tenth) is
              SLOW x the median of the others', by at least MIN_GAP, in CONFIRM checks in a
              row, is slow ("2.1x slower than the
              median rank: 210 ms of compute per step vs 100 ms")
    samples   for any other script, a look at every rank every SAMPLE_EVERY seconds (the
              hang watch's non-blocking looks): a rank that works while the others wait in a
              collective holds them up; one that did in HOLDS of the last SAMPLES looks, while
              no other did in more than one, is slow

A balanced job is named nothing. Each slow rank is named once (again only if another rank
becomes the slow one).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from .hang import RankLook

# Compute times kept per rank, and the fewest a rank needs before it is judged.
WINDOW = 20
FEWEST = 5
# How much slower than the others' median a slow rank is, at least (and by how much). Below
# 1.4x, the noise of a shared machine (seen on the testbed: a balanced job at 1.3x for half a
# minute) would be named.
SLOW = 1.4
MIN_GAP = 0.005
# Checks in a row (one every CHECK_EVERY s) a rank must stay slow by compute before it is
# named: a minute.
CONFIRM = 12
CHECK_EVERY = 5.0
# Waits kept per rank (one a beat report, about a second of steps each), the first beats of
# an attempt left out (the first steps run at their own pace: allocation, warm caches), and
# the fewest a rank needs before it is judged.
WAIT_WINDOW = 20
WARMUP = 5
FEWEST_WAITS = 10
# How much more work per step than the median rank a rank does, at least, to be named on
# waits: 1.1x names a rank 1.2x slow on a loaded shared machine and no balanced job there.
LAG = 1.1
# The least part of the lag a slow rank's extra wait for batches must be for its data loader
# to be named. A CI run saw a loader slowed 1.2x cost its rank 107 ms a step of which only
# 47 ms were waits for batches: the worker's own work (making each batch) took the rest from
# the rank's CPU.
DATA_SHARE = 1 / 3
# Checks in a row a rank must stay slow by waits: half a minute.
CONFIRM_WAIT = 6
# Looks at the ranks for jobs that report no compute time: every SAMPLE_EVERY s; a rank that
# held the others up in HOLDS of the last SAMPLES is slow.
SAMPLE_EVERY = 10.0
SAMPLES = 6
HOLDS = 5


class StepTiming(NamedTuple):
    """One beat of a rank: mean seconds per step blocked on the others, of the whole step,
    and waiting for its data loader. (A named tuple, not a frozen dataclass: one is made for
    every rank's beat, and a frozen dataclass's __init__ costs several times more.)"""

    wait: float
    cycle: float
    data: float = 0.0


@dataclass(frozen=True)
class Slow:
    """A rank named slow, and why herd thinks so."""

    host: str
    rank: int
    detail: str
    ratio: float | None = None
    causes: tuple[str, ...] = ()

    def line(self) -> str:
        text = f"{self.host} rank {self.rank} {self.detail}"
        if self.causes:
            text += f" (likely: {'; '.join(self.causes)})"
        return text


def typical(values: list[float]) -> float:
    """A rank's typical compute time: the mean without the slowest tenth (a GC pause, a
    page fault). Not the median: a rank held to a third of a CPU by a quota runs some forward
    passes at full speed inside its quota and the rest three times slower or more, and the
    median of such a mix is the full speed."""
    kept = sorted(values)[: len(values) - len(values) // 10]
    return statistics.fmean(kept)


def slow_by_compute(
    times: Mapping[tuple[str, int], Iterable[float]],
) -> Slow | None:
    """The slow rank by compute time per step, if one is (see the module docstring)."""
    medians = {
        key: typical(values)
        for key, values in ((k, list(v)) for k, v in times.items())
        if len(values) >= FEWEST
    }
    if len(medians) < 2:
        return None
    slowest = max(medians, key=lambda key: medians[key])
    others = statistics.median(v for k, v in medians.items() if k != slowest)
    mine = medians[slowest]
    if others <= 0 or mine < SLOW * others or mine - others < MIN_GAP:
        return None
    host, rank = slowest
    ratio = mine / others
    return Slow(
        host,
        rank,
        f"is {ratio:.1f}x slower than the median rank: {mine * 1000:.0f} ms of compute per "
        f"step vs {others * 1000:.0f} ms",
        ratio,
    )


def trimmed(values: list[float]) -> float:
    """The mean without the highest and the lowest tenth: one beat that carries a save or a
    collection on one rank (the others waited for it once) is not a slow rank."""
    cut = len(values) // 10
    return statistics.fmean(sorted(values)[cut : len(values) - cut])


def slow_by_waits(
    timings: Mapping[tuple[str, int], Iterable[StepTiming]],
) -> Slow | None:
    """The rank the others wait for, by who waits least, if one is (see the module
    docstring)."""
    means: dict[tuple[str, int], StepTiming] = {}
    for key, values in timings.items():
        kept = list(values)
        if len(kept) >= FEWEST_WAITS:
            means[key] = StepTiming(
                trimmed([t.wait for t in kept]),
                trimmed([t.cycle for t in kept]),
                trimmed([t.data for t in kept]),
            )
    if len(means) < 2:
        return None
    holder = min(means, key=lambda key: means[key].wait)
    others = [m for k, m in means.items() if k != holder]
    mine = means[holder]
    their_wait = statistics.median(m.wait for m in others)
    cycle = statistics.median(m.cycle for m in means.values())
    lag = their_wait - mine.wait
    their_work = cycle - their_wait
    if lag < MIN_GAP or their_work <= 0 or (cycle - mine.wait) < LAG * their_work:
        return None
    ratio = (cycle - mine.wait) / their_work
    causes: tuple[str, ...] = ()
    their_data = statistics.median(m.data for m in others)
    if mine.data - their_data >= lag * DATA_SHARE:
        causes = (
            f"its data loader: it waited {mine.data * 1000:.0f} ms a step for batches vs "
            f"{their_data * 1000:.0f} ms on the others",
        )
    host, rank = holder
    return Slow(
        host,
        rank,
        f"is {ratio:.2f}x slower than the median rank: the others wait {lag * 1000:.0f} ms "
        f"of every {cycle * 1000:.0f} ms step for it",
        ratio,
        causes,
    )


def waiting(look: RankLook) -> bool:
    """Whether a rank waits for the others at this look (in a collective, or idle where DDP
    waits for its all-reduce)."""
    return look.collective is not None or (look.maybe_waiting and look.active is False)


def held_by(round_: Iterable[RankLook]) -> tuple[str, int] | None:
    """The rank that held the others up at one look: it worked (or was stopped) while at
    least half of the others waited in a collective."""
    ranks = list(round_)
    working = [r for r in ranks if not waiting(r)]
    if len(ranks) < 2 or len(working) != 1:
        return None
    return working[0].host, working[0].rank


def slow_by_samples(rounds: Iterable[Iterable[RankLook]]) -> Slow | None:
    """The slow rank by who held the others up in the last SAMPLES looks, if one did."""
    kept = list(rounds)[-SAMPLES:]
    if len(kept) < SAMPLES:
        return None
    counts: dict[tuple[str, int], int] = {}
    where: dict[tuple[str, int], str] = {}
    for round_ in kept:
        looks = list(round_)
        holder = held_by(looks)
        if holder is None:
            continue
        counts[holder] = counts.get(holder, 0) + 1
        others = [r for r in looks if (r.host, r.rank) != holder]
        where[holder] = others[0].collective or others[0].where if others else "a collective"
    if not counts:
        return None
    holder = max(counts, key=lambda key: counts[key])
    runner_up = max((c for k, c in counts.items() if k != holder), default=0)
    if counts[holder] < HOLDS or runner_up > 1:
        return None
    return Slow(
        holder[0],
        holder[1],
        f"held the others up in {counts[holder]} of {len(kept)} looks (they waited in "
        f"{where[holder]} while it worked)",
    )


@dataclass
class StragglerWatch:
    """Compute times and looks in; ``check()`` names a slow rank, once."""

    times: dict[tuple[str, int], deque[float]] = field(default_factory=dict)
    waits: dict[tuple[str, int], deque[StepTiming]] = field(default_factory=dict)
    beats_seen: dict[tuple[str, int], int] = field(default_factory=dict)
    rounds: dict[int, list[RankLook]] = field(default_factory=dict)
    named: Slow | None = None
    _candidate: tuple[str, int] | None = None
    _streak: int = 0

    def computed(self, host: str, rank: int, seconds: float) -> None:
        self.times.setdefault((host, rank), deque(maxlen=WINDOW)).append(seconds)

    def still_slow(self, host: str, rank: int) -> bool:
        """The rank named slow is the one the latest checks still find, enough in a row."""
        return (
            self.named is not None
            and (self.named.host, self.named.rank) == (host, rank)
            and self._candidate == (host, rank)
            and self._streak >= min(CONFIRM, CONFIRM_WAIT)
        )

    def forget(self, hosts: Iterable[str]) -> None:
        """Drop what these nodes' ranks reported (their job went down: a new attempt there
        starts with a warm-up of its own)."""
        gone = set(hosts)
        for table in (self.times, self.waits, self.beats_seen):
            for key in [k for k in table if k[0] in gone]:
                del table[key]

    def timed(self, host: str, rank: int, timing: StepTiming) -> None:
        """A rank's beat with its waits (its first WARMUP beats are left out)."""
        key = (host, rank)
        self.beats_seen[key] = self.beats_seen.get(key, 0) + 1
        if self.beats_seen[key] > WARMUP:
            self.waits.setdefault(key, deque(maxlen=WAIT_WINDOW)).append(timing)

    @property
    def reports_compute(self) -> bool:
        return bool(self.times) or bool(self.beats_seen)

    def sampled(self, round_id: int, looks: Iterable[RankLook]) -> None:
        """One node's answer to the sample look ``round_id``."""
        self.rounds.setdefault(round_id, []).extend(looks)
        for old in sorted(self.rounds)[: -SAMPLES - 1]:
            del self.rounds[old]

    def check(self, world_size: int) -> Slow | None:
        """A newly named slow rank, if there is one now."""
        if self.reports_compute:
            waits = bool(self.beats_seen)
            found = slow_by_waits(self.waits) if waits else slow_by_compute(self.times)
            key = None if found is None else (found.host, found.rank)
            self._streak = self._streak + 1 if key is not None and key == self._candidate else 1
            self._candidate = key
            if found is None or self._streak < (CONFIRM_WAIT if waits else CONFIRM):
                return None
        else:
            complete = [
                looks for _, looks in sorted(self.rounds.items()) if len(looks) >= world_size
            ]
            found = slow_by_samples(complete)
            if found is None:
                return None
        if self.named is not None and (self.named.host, self.named.rank) == (
            found.host,
            found.rank,
        ):
            return None
        self.named = found
        return found
