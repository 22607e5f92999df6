"""Hang detection: silence makes herd look; what it sees decides.

Progress signals are each rank's output lines, the step beats a script sends with
``torchherd.progress.beat(step)`` (the Trainer does every step) and the phases it declares
(``progress.phase``). Silence alone is never a verdict. Once no rank has shown progress for
LOOK_AFTER seconds since the workers started (before the first step too), herd looks at every
rank without pausing it (agent.look: kernel state, CPU and I/O of its process tree, the main
thread's Python frames) and looks again every LOOK_EVERY seconds while the job stays silent
(less often while every look shows work). Between two looks each rank is:

    stopped   its process is stopped (state T: SIGSTOP, a debugger, a frozen container)
    working   it declared a phase, its frames moved, it read or wrote data, or it used CPU
              outside a collective: compiling, computing, saving, loading
    waiting   its main thread is in a collective (or the rendezvous, or a backward pass
              without CPU: DDP waiting for its all-reduce)
    idle      none of these: no CPU, no I/O, the same frames (blocked on a lock, a dead
              mount, a queue nobody fills)

The job is hung when, with no progress signal meanwhile:

    1. a rank has been stopped for CONFIRM s (it holds every collective up);
    2. nobody works, some ranks wait, and a rank has been idle for CONFIRM s (it will never
       reach the collective the others wait in);
    3. nobody has worked for ALL_WAITING s (every rank waits, or waits and idles: a lost
       peer, a firewall, a dead link);
    4. every rank holds a GPU and has stayed at the same frames with no I/O for ALL_STUCK s,
       whatever its CPU (ranks spinning on a GPU that never finishes: the CPU waits on the
       stream at full speed). On CPU-only ranks the same picture is a long computation in
       one line, which is work.

A working rank keeps the job alive however long it works (a 10-minute compile, a 30-minute
evaluation that prints nothing, a 5-minute save), even while the others wait for it. Where no
frames can be taken (py-spy missing, ptrace not allowed), rules 1 and 3 still hold.

``--hang-timeout S`` adds a plain limit: S seconds without any progress signal, counted from
the first one (start-up has its own timeouts), is a hang whatever the looks say (0 turns the
whole watch off).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Seconds of silence (no line, beat or phase change from any rank) before herd looks.
LOOK_AFTER = 10.0
# Seconds between looks while something looks wrong; up to LOOK_EVERY_MAX while all works.
LOOK_EVERY = 5.0
LOOK_EVERY_MAX = 60.0
# Seconds a rank must stay stopped (or idle while others wait) before the job is hung.
CONFIRM = 10.0
# Seconds nobody may work (everyone waits or idles) before the job is hung.
ALL_WAITING = 120.0
# Seconds every rank may stay at the same frames with no I/O, CPU or not, before a hang.
ALL_STUCK = 300.0
# Share of one core above which a rank outside a collective counts as working.
CPU_BUSY = 0.05
# Bytes read or written between two looks that count as work (a save, a load, a download).
IO_MOVING = 256 * 1024

# Frames of a main thread that waits for other ranks: collectives, the rendezvous and process
# group set-up, point-to-point, DDP's syncs, a work handle's wait, the store.
_COLLECTIVE = re.compile(
    r"^(all_reduce\w*|allreduce\w*|all_gather\w*|_all_gather\w*|reduce_scatter\w*|"
    r"_reduce_scatter\w*|reduce|broadcast\w*|_broadcast\w*|barrier|monitored_barrier|"
    r"all_to_all\w*|gather|scatter|gather_object|scatter_object_list|recv|send|irecv|isend|"
    r"batch_isend_irecv|wait|_wait|synchronize|_sync_\w+|sync_\w+|_verify_params_across_\w+|"
    r"init_process_group|_new_process_group_helper|new_group|_store_based_barrier|"
    r"rendezvous|_rendezvous_helper|_create_c10d_store|_env_rendezvous_handler|"
    r"init_device_mesh|_init_process_groups|get|wait_for_workers)$"
)
# Frames that wait when the rank uses no CPU, and compute when it does.
_MAYBE_WAITING = re.compile(r"^(backward|_engine_run_backward|run_backward|step|forward)$")
_FRAME_NAME = re.compile(r"^(\S+) \(")


def _name(frame: str) -> str:
    match = _FRAME_NAME.match(frame)
    return match.group(1) if match else frame


def _in_torch_distributed(frame: str) -> bool:
    return "distributed" in frame or "c10d" in frame


@dataclass(frozen=True)
class RankLook:
    """One rank as one look saw it (see agent.look)."""

    host: str
    rank: int
    pid: int
    at: float
    """When the launcher received the look (its own clock: nodes' clocks may disagree)."""
    state: str
    cpu: int
    """CPU ticks of the rank's process tree so far."""
    io: int | None
    frames: tuple[str, ...] | None
    """The main thread's frames, innermost first; None when they could not be taken."""
    ticks: int = 100
    phase: str | None = None
    error: str | None = None
    gpu: bool = False
    """The rank has an NVIDIA GPU open."""
    active: bool | None = None
    """py-spy's word on whether the main thread was running on a CPU at the look."""

    @classmethod
    def from_event(cls, host: str, event: Mapping[str, Any], at: float) -> list[RankLook]:
        looks = []
        for seen in event.get("ranks", []):
            try:
                frames = seen.get("frames")
                looks.append(
                    cls(
                        host=host,
                        rank=int(seen["rank"]),
                        pid=int(seen["pid"]),
                        at=at,
                        state=str(seen.get("state", "?")),
                        cpu=int(seen.get("cpu") or 0),
                        io=None if seen.get("io") is None else int(seen["io"]),
                        frames=None if frames is None else tuple(str(f) for f in frames),
                        ticks=int(event.get("ticks") or 100),
                        phase=seen.get("phase") or None,
                        error=seen.get("error"),
                        gpu=bool(seen.get("gpu")),
                        active=seen.get("active") if isinstance(seen.get("active"), bool) else None,
                    )
                )
            except (KeyError, TypeError, ValueError):
                continue
        return looks

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")

    @property
    def collective(self) -> str | None:
        """The collective the main thread waits in (its innermost such frame), if any."""
        for frame in self.frames or ():
            name = _name(frame)
            if _COLLECTIVE.match(name) and (
                _in_torch_distributed(frame) or name not in ("get", "wait", "reduce", "gather")
            ):
                return frame
        return None

    @property
    def maybe_waiting(self) -> bool:
        return any(_MAYBE_WAITING.match(_name(f)) for f in self.frames or ())

    @property
    def where(self) -> str:
        return self.frames[0] if self.frames else "unknown"


STOPPED, WORKING, WAITING, IDLE = "stopped", "working", "waiting", "idle"


def activity(before: RankLook, after: RankLook) -> str:
    """What a rank did between two looks of the same process (see the module docstring)."""
    if after.stopped:
        return STOPPED
    if after.phase:
        return WORKING
    seconds = max(after.at - before.at, 1e-3)
    busy = (after.cpu - before.cpu) / (after.ticks * seconds) >= CPU_BUSY
    moved = after.frames is not None and before.frames is not None and after.frames != before.frames
    io = after.io is not None and before.io is not None and after.io - before.io >= IO_MOVING
    if moved or io:
        return WORKING
    if after.collective is not None:
        return WAITING
    if after.maybe_waiting:
        return WORKING if busy else WAITING
    return WORKING if busy else IDLE


@dataclass(frozen=True)
class Hang:
    """A detected hang: the rule that found it, in words, and the ranks that hold it up."""

    reason: str
    behind: tuple[str, ...] = ()
    """One line per rank that holds the others up ("node2 rank 1: stopped at ...")."""
    silent_for: float = 0.0

    def describe(self) -> str:
        return self.reason


@dataclass
class _RankTrack:
    looks: list[RankLook] = field(default_factory=list)
    still_since: float | None = None
    """Start of the current run of looks in which the rank did not work."""
    kind_since: tuple[str, float] | None = None
    """The rank's current activity and since when it has held."""
    same_frames_since: float | None = None
    """Since when its frames and I/O have not changed (CPU or not)."""


def judge(tracks: Mapping[int, _RankTrack], world_size: int, now: float) -> Hang | None:
    """The verdict over every rank's looks since the job went silent (rules 1-4)."""
    current: dict[int, tuple[str, float, RankLook]] = {}
    for rank, track in tracks.items():
        if track.kind_since is not None and track.looks:
            kind, since = track.kind_since
            current[rank] = (kind, since, track.looks[-1])
    stopped = [
        (rank, look)
        for rank, (kind, since, look) in current.items()
        if kind == STOPPED and now - since >= CONFIRM
    ]
    if stopped:
        return Hang(
            f"{_ranks(stopped)} stopped (state T: SIGSTOP, a debugger, a frozen machine) "
            f"for {max(now - current[r][1] for r, _ in stopped):.0f} s",
            tuple(
                f"{look.host} rank {rank}: stopped (state T: SIGSTOP, a debugger) at {look.where}"
                for rank, look in stopped
            ),
        )
    if len(current) < world_size:
        return None  # a rank is not seen yet: only a stopped rank is judged
    same = [tracks[r].same_frames_since for r in current]
    if all(s is not None for s in same) and all(
        current[r][2].frames is not None and current[r][2].gpu for r in current
    ):
        stuck_for = now - max(s for s in same if s is not None)
        if stuck_for >= ALL_STUCK:
            return Hang(
                f"every rank has stayed at the same place for {stuck_for:.0f} s with no I/O "
                f"(limit {ALL_STUCK:.0f} s): spinning on something that never finishes",
                _odd_ones(current),
            )
    if any(k == WORKING for k, _, _ in current.values()):
        return None  # a rank works: the others wait for it
    waiting = [(r, look) for r, (kind, _, look) in current.items() if kind == WAITING]
    idle = [
        (r, look)
        for r, (kind, since, look) in current.items()
        if kind == IDLE and now - since >= CONFIRM
    ]
    if waiting and idle:
        where = waiting[0][1].collective or waiting[0][1].where
        return Hang(
            f"{_ranks(idle)} idle (no CPU, no I/O, the same frames) while the others wait "
            f"in {where}",
            tuple(
                f"{look.host} rank {r}: blocked at {look.where} (no CPU, no I/O) while the "
                f"others wait in {where}"
                for r, look in idle
            ),
        )
    still = [tracks[r].still_since for r in current]
    if all(s is not None for s in still):
        nobody_for = now - max(s for s in still if s is not None)
        if nobody_for >= ALL_WAITING:
            return Hang(
                f"no rank has worked for {nobody_for:.0f} s: every rank waits or idles "
                f"(limit {ALL_WAITING:.0f} s)",
                _odd_ones(current),
            )
    return None


def _ranks(items: list[tuple[int, RankLook]]) -> str:
    names = [f"{look.host} rank {rank}" for rank, look in sorted(items)]
    return ", ".join(names)


def _odd_ones(current: Mapping[int, tuple[str, float, RankLook]]) -> tuple[str, ...]:
    """The ranks not where most ranks are (the ones likely to hold the others up)."""
    places: dict[str, list[int]] = {}
    for rank, (_, _, look) in current.items():
        places.setdefault(look.collective or look.where, []).append(rank)
    if len(places) < 2:
        return ()
    common = max(places, key=lambda p: len(places[p]))
    return tuple(
        f"{current[r][2].host} rank {r}: at {place} while most ranks are at {common}"
        for place, ranks in places.items()
        if place != common
        for r in sorted(ranks)
    )


class HangWatch:
    """Progress signals and looks in; ``check()`` says whether the job is hung, and
    ``wants_look()`` when to look again."""

    def __init__(
        self,
        timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        world_size: int = 0,
    ) -> None:
        """``timeout``: None judges by evidence only, 0 turns the watch off, S > 0 adds a
        plain limit of S seconds without any progress signal."""
        self.timeout = timeout
        self.world_size = world_size
        self._clock = clock
        self._since: float | None = None
        """Start of the current silence (the workers' start, or the last progress signal)."""
        self._tracks: dict[int, _RankTrack] = {}
        self._next_look: float | None = None
        self._interval = LOOK_EVERY
        self.steps: dict[int, int] = {}
        """The highest step each rank reported."""
        self.last_signal: dict[int, float] = {}
        """When each rank last showed progress (clock time)."""
        self.phases: dict[int, str] = {}
        """The long phase each rank has declared, while it runs."""
        self._signalled = False

    @property
    def enabled(self) -> bool:
        return self.timeout != 0

    def started(self) -> None:
        """The workers are starting: silence counts from now (a hang before the first step
        is found like any other)."""
        if self._since is None:
            self._reset(self._clock())

    def signal(self, rank: int | None, step: int | None = None) -> None:
        """A rank showed progress (an output line, or a beat at ``step``)."""
        if rank is None:
            return
        now = self._clock()
        self.last_signal[rank] = now
        self._signalled = True
        if step is not None and step >= self.steps.get(rank, -1):
            self.steps[rank] = step
        self._reset(now)

    def phase(self, rank: int | None, name: str | None) -> None:
        """A rank declared a long phase (or ended it: ``name`` None)."""
        if rank is None:
            return
        if name:
            self.phases[rank] = name
        else:
            self.phases.pop(rank, None)
        self._reset(self._clock())

    def excuse(self, seconds: float) -> None:
        """This launcher did not run for ``seconds`` (stopped, suspended, starved): that time
        is not the job's silence, and looks taken before it are stale."""
        if self._since is not None:
            self._reset(self._since + seconds)

    def _reset(self, since: float) -> None:
        self._since = since
        self._tracks.clear()
        self._interval = LOOK_EVERY
        self._next_look = since + LOOK_AFTER

    @property
    def max_step(self) -> int | None:
        return max(self.steps.values()) if self.steps else None

    def silent_for(self) -> float:
        return 0.0 if self._since is None else self._clock() - self._since

    def wants_look(self) -> bool:
        """Whether herd should look at the ranks now (the job has been silent long enough)."""
        if not self.enabled or self._next_look is None:
            return False
        if self._clock() >= self._next_look:
            self._next_look = self._clock() + self._interval
            return True
        return False

    def looked(self, host: str, event: Mapping[str, Any]) -> None:
        """A node's answer to a look ({"e": "look"}): follow each rank from look to look."""
        if self._since is None:
            return
        for look in RankLook.from_event(host, event, self._clock()):
            track = self._tracks.setdefault(look.rank, _RankTrack())
            previous = track.looks[-1] if track.looks else None
            if previous is not None and previous.pid != look.pid:
                track = self._tracks[look.rank] = _RankTrack()
                previous = None
            track.looks.append(look)
            del track.looks[:-3]
            if previous is None:
                if look.stopped:
                    track.kind_since = (STOPPED, look.at)
                continue
            kind = activity(previous, look)
            if track.kind_since is None or track.kind_since[0] != kind:
                track.kind_since = (kind, previous.at if kind != STOPPED else look.at)
            if kind == WORKING:
                track.still_since = None
            elif track.still_since is None:
                track.still_since = previous.at
            unchanged = look.frames == previous.frames and not (
                look.io is not None
                and previous.io is not None
                and look.io - previous.io >= IO_MOVING
            )
            if not unchanged or look.phase:
                track.same_frames_since = None
            elif track.same_frames_since is None:
                track.same_frames_since = previous.at
        kinds = {t.kind_since[0] for t in self._tracks.values() if t.kind_since}
        # Everyone at work: look less often. Anything else: keep looking closely.
        calm = bool(kinds) and kinds == {WORKING}
        self._interval = min(self._interval * 2, LOOK_EVERY_MAX) if calm else LOOK_EVERY

    def check(self) -> Hang | None:
        """The hang, if the job is hung (see the module docstring)."""
        if not self.enabled or self._since is None:
            return None
        silent = self._clock() - self._since
        if (
            self.timeout is not None
            and self._signalled
            and silent > self.timeout
            and not self.phases
        ):
            return Hang(
                f"no progress from any rank for {silent:.0f} s (limit {self.timeout:g} s, set "
                "by --hang-timeout)",
                silent_for=silent,
            )
        now = max((t.looks[-1].at for t in self._tracks.values() if t.looks), default=None)
        if now is None:
            return None
        found = judge(self._tracks, self.world_size, now)
        if found is None:
            return None
        return Hang(found.reason, found.behind, silent)
