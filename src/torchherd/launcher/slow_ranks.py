"""The slow-rank watch of one attempt: feeds recovery.straggler and says what it finds.

Waits and compute times come with the Trainer's beats; jobs that report none are looked at every
SAMPLE_EVERY seconds while they make progress (a silent job is the hang watch's). Every
CHECK_EVERY seconds the watch judges; a rank newly named slow is announced once its node has
said what it can about why (agent.slow: a CPU quota, a busy node, a stopped process, GPU
clocks), or after WHY_WAIT seconds without an answer.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping
from typing import Any

from ..recovery.hang import LOOK_AFTER, RankLook
from ..recovery.straggler import CHECK_EVERY, SAMPLE_EVERY, Slow, StepTiming, StragglerWatch
from .links import AgentLink

# Seconds the announcement waits for the node's word on the likely cause.
WHY_WAIT = 5.0


class SlowRanks:
    """Slow ranks of one attempt: compute times and sample looks in, one line per slow rank
    out (``say``), and each named rank handed to ``on_slow`` (the job record)."""

    def __init__(
        self,
        links: Mapping[str, AgentLink],
        running: Callable[[], list[str]],
        silent_for: Callable[[], float],
        world_size: int,
        say: Callable[[str], None],
        on_slow: Callable[[Slow], None] | None = None,
        on_timing: Callable[[str, int, StepTiming], None] | None = None,
        start_over: Callable[[], bool] = lambda: True,
    ) -> None:
        self.links = links
        self.running = running
        self.silent_for = silent_for
        self.world_size = world_size
        self.say = say
        self.on_slow = on_slow
        self.on_timing = on_timing
        """Also handed every timing (replica groups: a judge across the groups' jobs)."""
        self.start_over = start_over
        """Whether the attempt's start is over (a rank showed progress, or every node's
        workers run): no sample before it (see run)."""
        self.watch = StragglerWatch()
        self.named: list[Slow] = []
        self._ids = itertools.count(1)
        self._samples: set[int] = set()
        self._why: dict[tuple[str, int], asyncio.Future[list[str]]] = {}

    def reported(self, host: str, beats: list[list[Any]]) -> None:
        """One report of a node: each rank's newest beat, [rank, step, at, compute, wait,
        cycle, data] (rank an int; the timings None or missing when not measured)."""
        for beat in beats:
            rank = beat[0]
            self.computed(host, rank, beat[3])
            if len(beat) >= 6:
                self.timed(host, rank, beat[4], beat[5], beat[6] if len(beat) >= 7 else None)

    def computed(self, host: str, rank: object, seconds: object) -> None:
        """A rank's compute seconds for its latest step, from its beat (None: not reported)."""
        if isinstance(rank, int) and isinstance(seconds, int | float):
            self.watch.computed(host, rank, float(seconds))

    def timed(self, host: str, rank: int, wait: object, cycle: object, data: object) -> None:
        """A rank's waits for its latest steps, from its beat (None: not reported)."""
        if isinstance(wait, int | float) and isinstance(cycle, int | float):
            spent = float(data) if isinstance(data, int | float) else 0.0
            timing = StepTiming(float(wait), float(cycle), spent)
            self.watch.timed(host, rank, timing)
            if self.on_timing is not None:
                self.on_timing(host, rank, timing)

    def looked(self, host: str, event: Mapping[str, Any], at: float) -> None:
        """A look event; only the ones this watch asked for count as samples."""
        look_id = event.get("id")
        if isinstance(look_id, int) and look_id in self._samples:
            self.watch.sampled(look_id, RankLook.from_event(host, event, at))

    def why(self, host: str, event: Mapping[str, Any]) -> None:
        waiting = self._why.get((host, int(event.get("r", -1))))
        if waiting is not None and not waiting.done():
            waiting.set_result([str(c) for c in event.get("causes") or []])

    async def run(self) -> None:
        """Sample and judge while the attempt runs (cancelled with it)."""
        since_sample = since_check = 0.0
        while True:
            await asyncio.sleep(1.0)
            since_sample += 1.0
            since_check += 1.0
            quiet = self.silent_for() >= LOOK_AFTER
            # No rank can be slower than the others before the job steps: while herd still
            # starts nodes (minutes, on a thousand), the ones started wait at the rendezvous,
            # and a look at every rank of each of them every SAMPLE_EVERY s finds only that.
            due = since_sample >= SAMPLE_EVERY and self.start_over()
            if due and not self.watch.reports_compute and not quiet:
                since_sample = 0.0
                look_id = next(self._ids)
                self._samples.add(look_id)
                for host in self.running():
                    link = self.links.get(host)
                    if link is not None:
                        link.command("look", id=look_id)
            if since_check >= CHECK_EVERY:
                since_check = 0.0
                found = self.watch.check(self.world_size)
                if found is not None:
                    await self.announce(found)

    async def announce(self, found: Slow) -> Slow:
        """Say a rank of this attempt is slow, with its node's word on the likely cause."""
        link = self.links.get(found.host)
        causes: list[str] = []
        if link is not None:
            waiting: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
            self._why[(found.host, found.rank)] = waiting
            link.command("why-slow", rank=found.rank)
            try:
                causes = await asyncio.wait_for(waiting, WHY_WAIT)
            except TimeoutError:
                causes = []
        named = Slow(found.host, found.rank, found.detail, found.ratio, (*found.causes, *causes))
        self.named.append(named)
        self.say(f"herd: slow rank: {named.line()}")
        if self.on_slow is not None:
            self.on_slow(named)
        return named
