"""Hang detection: silence makes herd look; what it sees decides.

Progress signals are each rank's output lines, the step beats a script sends with
``torchherd.progress.beat(step)`` (the Trainer does every step) and the phases it declares
(``progress.phase``). Silence alone is never a verdict. Once no rank has shown progress for
LOOK_AFTER seconds since the workers started (before the first step too; until a rank shows
progress, since the last node's workers started: the nodes started first wait at the
rendezvous for the others by design), herd looks at every rank without pausing it
(agent.look: kernel state, CPU and I/O of its process tree, the main thread's Python frames,
the system call and wait channel it is blocked in, its context switches) and looks again
every LOOK_EVERY seconds while the job stays silent (less often while every look shows work).
Between two looks each rank is:

    stopped   its process is stopped (state T: SIGSTOP, a debugger, a frozen container)
    working   its frames moved, it read or wrote data, or it used CPU outside a collective:
              compiling, computing, saving, loading
    waiting   its main thread is in a collective (or the rendezvous, or a backward pass
              without CPU: DDP waiting for its all-reduce)
    outside   it waits on the world outside the job: blocked reading a socket, in a poll or
              select, on a file lock, in a sleep, in disk wait (state D: a slow NFS or Lustre
              mount), or in a socket, lock or sleep frame; or its main thread keeps waking up
              (its context switches rise from look to look): a download, a retry's backoff,
              ``main_process_first``'s lock, a hiccupping mount
    idle      none of these: no CPU, no I/O, the same frames, no wake-up, blocked on something
              of the job's own (a lock between its threads, a queue nobody fills)

A rank whose main thread waits for a batch from its DataLoader's worker processes is as they
are: its own polling (it wakes every few seconds to check that they live) is no sign of life.
Where they use no CPU and do no I/O, it waits outside the job if a thread of one of them
does (a read from an object store, through a thread pool too; a sleep; disk wait), and it is
idle otherwise: a worker blocked on a
lock (one held by another thread at the fork), or every worker waiting for work while the
rank waits for a batch that will never come.

A rank in a declared phase counts as working, whatever it shows, for the phase's limit
(``phase(name, limit=S)``; PHASE_LIMIT, 30 minutes, by default), unless it stays idle (no CPU,
no I/O, no frame change, no wake-up) for the frozen-phase limit (``--hang-timeout`` when set,
else OUTSIDE_LIMIT): then it is judged like any idle rank.

The job is hung when, with no progress signal meanwhile:

    1. a rank has been stopped for CONFIRM s (it holds every collective up);
    2. nobody works, some ranks wait, and a rank has been idle for the confirmation window
       (it will never reach the collective the others wait in);
    3. nobody has worked or waited outside for the all-waiting limit (every rank waits, or
       waits and idles: a lost peer, a firewall, a dead link);
    4. every rank holds a GPU and has stayed at the same frames with no I/O for ALL_STUCK s,
       whatever its CPU (ranks spinning on a GPU that never finishes: the CPU waits on the
       stream at full speed). On CPU-only ranks the same picture is a long computation in
       one line, which is work;
    5. a rank has waited outside the job for OUTSIDE_LIMIT s (minutes, not seconds: a server
       that never answers, a lock never released, a mount that never comes back);
    6. a rank has been in a phase for longer than the phase's limit;
    7. some ranks finished (their node's workers all exited 0, or the rank left the looks)
       and another is still running FINISH_GRACE s later without working: the job finished,
       but that rank never exited (a non-daemon thread, a hung exit handler).

Before a node has started its workers there is no rank to look at, and torchrun itself (the
node's elastic agent) is judged from its own process (``torchrun`` in a look):

    8. a node's torchrun has been stopped (state T) for CONFIRM s before starting its workers
       (its peers wait for it in the rendezvous, for torch's own timeouts: 10 minutes);
    9. no node has started its workers and no node's torchrun has worked (no CPU, no I/O, no
       disk wait) for START_LIMIT s: every start-up waits, and nothing moves.

The windows follow the job's own pace: the confirmation window is CONFIRM s or CONFIRM_STEPS
steps, whichever is longer, and the all-waiting limit ALL_WAITING s or ALL_WAITING_STEPS steps;
before the first step (communicators still being set up, which takes minutes on large jobs) it
is FIRST_COLLECTIVE s. A stopped rank is named within CONFIRM s whatever the pace: nothing a
stopped process does is slow work.

A working rank keeps the job alive however long it works (a 10-minute compile, a 30-minute
evaluation that prints nothing, a 5-minute save), even while the others wait for it. Where no
frames can be taken (py-spy missing, ptrace not allowed), rules 1, 3, 5, 7, 8 and 9
still hold.

``--hang-timeout S`` adds a plain limit: S seconds without any progress signal, counted from
the first one (start-up has its own timeouts), is a hang whatever the looks say, inside a
declared phase too (0 turns the whole watch off). Once some ranks finished it bounds rule 7
instead: a rank still running S s after them never exited (the job's work is done, nothing is
restarted), which the plain limit alone would have called a hang and restarted.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..progress import PHASE_LIMIT  # seconds a phase without a limit of its own may last

# Seconds of silence (no line, beat or phase change from any rank) before herd looks.
LOOK_AFTER = 10.0
# Seconds between looks while something looks wrong; up to LOOK_EVERY_MAX while all works.
LOOK_EVERY = 5.0
LOOK_EVERY_MAX = 60.0
# Seconds a rank must stay stopped (or idle while others wait) before the job is hung.
CONFIRM = 10.0
# ... or this many of the job's own steps, when longer (a slow job's ranks pause longer).
CONFIRM_STEPS = 3.0
# Seconds nobody may work (everyone waits or idles) before the job is hung...
ALL_WAITING = 120.0
# ... or this many steps, when longer...
ALL_WAITING_STEPS = 10.0
# ... and before the first step: a large job's communicators can take minutes to set up.
FIRST_COLLECTIVE = 300.0
# Seconds a rank may wait on the world outside the job (a socket, a lock, a sleep, a slow
# mount) before the job is hung: downloads, backoffs and mount hiccups take minutes.
OUTSIDE_LIMIT = 600.0
# Seconds a rank may go on running once other ranks finished, when it is not working.
FINISH_GRACE = 60.0
# Seconds every rank may stay at the same frames with no I/O, CPU or not, before a hang.
ALL_STUCK = 300.0
# Seconds torchrun may go without starting its workers while no node's torchrun works (no
# CPU, no I/O, no disk wait): the start-up limit; as long as the first collective's floor.
START_LIMIT = FIRST_COLLECTIVE
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
# Innermost frames that wait on the world outside the job: sockets and HTTP, file locks, sleeps
# (py-spy shows time.sleep's caller, so a sleep is known by its system call instead).
_OUTSIDE_FRAME = re.compile(
    r"\((\S*/)?(socket|ssl|selectors|http/client|urllib3/\S+|requests/\S+|filelock/\S+|"
    r"_filelock|aiohttp/\S+|httpx/\S+|httpcore/\S+)\.py:"
)
_FRAME_NAME = re.compile(r"^(\S+) \(")
# A DataLoader worker's loop, and the queue it waits on for the next batch's indices.
# (py-spy names a method with its class: "Queue.get (multiprocessing/queues.py:113)".)
_WORKER_LOOP = re.compile(r"^_worker_loop \((\S*/)?torch/utils/data/_utils/worker\.py:")
_INDEX_WAIT = re.compile(r"^(Queue\.)?get \((\S*/)?multiprocessing/queues\.py:")


def _name(frame: str) -> str:
    match = _FRAME_NAME.match(frame)
    return match.group(1) if match else frame


def _in_torch_distributed(frame: str) -> bool:
    return "distributed" in frame or "c10d" in frame


@dataclass(frozen=True)
class LoaderLook:
    """One of a rank's DataLoader worker processes, seen while the rank waited for a batch."""

    pid: int
    state: str
    outside: str | None
    """What its main thread waits on outside the job, in words (agent.workers)."""
    frames: tuple[str, ...] | None

    @classmethod
    def from_event(cls, seen: Mapping[str, Any]) -> LoaderLook:
        frames = seen.get("frames")
        return cls(
            pid=int(seen["pid"]),
            state=str(seen.get("state", "?")),
            outside=seen.get("outside") or None,
            frames=None if frames is None else tuple(str(f) for f in frames),
        )

    @property
    def waits_for_work(self) -> bool:
        """It waits for the next batch's indices from the rank: it has nothing to do."""
        frames = self.frames or ()
        return any(
            _WORKER_LOOP.match(frame) and index > 0 and _INDEX_WAIT.match(frames[index - 1])
            for index, frame in enumerate(frames)
        )

    @property
    def waits_outside(self) -> str | None:
        if self.state == "D":
            return "disk wait (state D: a slow or hung mount)"
        if self.waits_for_work:
            return None  # its poll is on the rank's own queue
        if self.outside:
            return self.outside
        if self.frames and _OUTSIDE_FRAME.search(self.frames[0]):
            return f"a wait at {self.frames[0]}"
        return None

    @property
    def where(self) -> str:
        at = self.frames[0] if self.frames else "unknown"
        state = " (stopped: state T)" if self.state in ("T", "t") else ""
        return f"its data-loader worker (pid {self.pid}){state} at {at}"


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
    outside: str | None = None
    """What the main thread waits on outside the job, in words (agent.workers)."""
    wakes: int | None = None
    """The main thread's context switches so far."""
    disk: int = 0
    """Threads of the rank in disk wait (state D)."""
    phase_limit: float | None = None
    """Seconds the declared phase may last, when the script said."""
    loader: tuple[LoaderLook, ...] = ()
    """Its DataLoader's worker processes, when its main thread waited for a batch from them
    (the agent looks at them only then: agent.look)."""

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
                        outside=seen.get("outside") or None,
                        wakes=_int_or_none((seen.get("main") or {}).get("switches")),
                        disk=int(seen.get("disk") or 0),
                        phase_limit=_float_or_none(seen.get("phase_limit")),
                        loader=tuple(LoaderLook.from_event(c) for c in seen.get("loader") or ()),
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
    def waits_for_loader(self) -> bool:
        """Its main thread waits for a batch from its DataLoader's worker processes."""
        return bool(self.loader)

    @property
    def holding_worker(self) -> LoaderLook | None:
        """The loader worker it waits for: one that is not waiting for work, else the first."""
        if not self.waits_for_loader:
            return None
        return next((w for w in self.loader if not w.waits_for_work), self.loader[0])

    @property
    def where(self) -> str:
        worker = self.holding_worker
        if worker is not None:
            return worker.where
        return self.frames[0] if self.frames else "unknown"

    @property
    def waits_outside(self) -> str | None:
        """What the rank waits on outside the job, in words, from the kernel or its frames
        (for a rank waiting for its loader workers: what they wait on)."""
        if self.waits_for_loader:
            for worker in self.loader:
                if (words := worker.waits_outside) is not None:
                    return f"{words}, in its data-loader worker (pid {worker.pid})"
            return None
        if self.outside:
            return self.outside
        if self.state == "D" or self.disk:
            return "disk wait (state D: a slow or hung mount)"
        if self.frames and _OUTSIDE_FRAME.search(self.frames[0]):
            return f"a wait at {self.frames[0]}"
        return None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float_or_none(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


STOPPED, WORKING, WAITING, OUTSIDE, IDLE = "stopped", "working", "waiting", "outside", "idle"


def woke(before: RankLook, after: RankLook) -> bool:
    """Whether the main thread was switched in and out between the looks (it keeps waking)."""
    return after.wakes is not None and before.wakes is not None and after.wakes > before.wakes


def activity(before: RankLook, after: RankLook) -> str:
    """What a rank did between two looks of the same process (see the module docstring); a
    declared phase is not taken into account here (HangWatch does)."""
    if after.stopped:
        return STOPPED
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
    if busy:
        return WORKING
    if after.waits_for_loader:
        # Its own wake-ups only check that its loader workers live: it is as they are.
        return OUTSIDE if after.waits_outside is not None else IDLE
    if after.waits_outside is not None or woke(before, after):
        return OUTSIDE
    return IDLE


@dataclass(frozen=True)
class Hang:
    """A detected hang: the rule that found it, in words, and the ranks that hold it up."""

    reason: str
    behind: tuple[str, ...] = ()
    """One line per rank that holds the others up ("node2 rank 1: stopped at ...")."""
    silent_for: float = 0.0
    finished: bool = False
    """Rule 7: the job's work finished and only a rank's exit is missing (not a hang to
    restart from: the job ends as finished)."""
    node: str | None = None
    """The one node the verdict names when it names no rank (its torchrun: rules 8 and 9)."""

    def describe(self) -> str:
        return self.reason


@dataclass(frozen=True)
class TorchrunLook:
    """A node's torchrun as one look saw it, while it has no workers (see agent.look)."""

    host: str
    pid: int
    at: float
    state: str
    cpu: int
    io: int | None

    @classmethod
    def from_event(cls, host: str, event: Mapping[str, Any], at: float) -> TorchrunLook | None:
        seen = event.get("torchrun")
        if not isinstance(seen, Mapping):
            return None
        try:
            return cls(
                host=host,
                pid=int(seen["pid"]),
                at=at,
                state=str(seen.get("state", "?")),
                cpu=int(seen.get("cpu") or 0),
                io=None if seen.get("io") is None else int(seen["io"]),
            )
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")

    def worked_since(self, before: TorchrunLook, ticks: int = 100) -> bool:
        """CPU, I/O or disk wait since ``before``: importing, loading, setting up."""
        seconds = max(self.at - before.at, 1e-3)
        busy = (self.cpu - before.cpu) / (ticks * seconds) >= CPU_BUSY
        io = self.io is not None and before.io is not None and self.io - before.io >= IO_MOVING
        return busy or io or self.state == "D"


@dataclass
class _StartTrack:
    """A node's torchrun while no worker of it has been seen."""

    last: TorchrunLook
    stopped_since: float | None = None
    still_since: float | None = None
    """Start of the current run of looks in which it did not work."""


def judge_start(starts: Mapping[str, _StartTrack], nodes_with_ranks: int) -> Hang | None:
    """Rules 8 and 9: a node's torchrun before it has started its workers."""
    if not starts:
        return None
    now = max(t.last.at for t in starts.values())
    stopped = sorted(
        (host, t)
        for host, t in starts.items()
        if t.stopped_since is not None and now - t.stopped_since >= CONFIRM
    )
    if stopped:
        longest = max(now - t.stopped_since for _, t in stopped if t.stopped_since is not None)
        return Hang(
            f"{', '.join(h for h, _ in stopped)}: torchrun stopped (state T: SIGSTOP, a "
            f"debugger, a frozen machine) before starting its workers, for {longest:.0f} s",
            tuple(
                f"{host}: torchrun (pid {t.last.pid}) stopped before starting its workers"
                for host, t in stopped
            ),
            node=stopped[0][0] if len(stopped) == 1 else None,
        )
    still = [t.still_since for t in starts.values()]
    if nodes_with_ranks == 0 and all(s is not None for s in still):
        idle_for = now - max(s for s in still if s is not None)
        if idle_for >= START_LIMIT:
            return Hang(
                f"no node has started its workers, and no torchrun has worked for "
                f"{idle_for:.0f} s (limit {START_LIMIT:.0f} s)",
                tuple(
                    f"{host}: torchrun (pid {t.last.pid}) waits, no workers started"
                    for host, t in sorted(starts.items())
                ),
            )
    return None


@dataclass
class _RankTrack:
    looks: list[RankLook] = field(default_factory=list)
    still_since: float | None = None
    """Start of the current run of looks in which the rank neither worked nor waited outside."""
    kind_since: tuple[str, float] | None = None
    """The rank's current activity (a phase aside) and since when it has held."""
    same_frames_since: float | None = None
    """Since when its frames and I/O have not changed (CPU or not)."""
    phase_seen: tuple[str, float] | None = None
    """The phase the rank is in and since when (this launcher's clock)."""


@dataclass(frozen=True)
class Limits:
    """The windows of one verdict, in seconds (see the module docstring)."""

    confirm: float = CONFIRM
    all_waiting: float = FIRST_COLLECTIVE
    outside: float = OUTSIDE_LIMIT
    frozen_phase: float = OUTSIDE_LIMIT
    finish_grace: float = FINISH_GRACE
    finished_working: float = OUTSIDE_LIMIT
    """How long a rank that works may go on once others finished (rule 7)."""

    @classmethod
    def for_pace(
        cls, step_seconds: float | None, stepped: bool, hang_timeout: float | None = None
    ) -> Limits:
        """The windows for a job that takes ``step_seconds`` a step (None: unknown), has made
        a step already or not, and runs with ``--hang-timeout`` (None: not set), which also
        bounds rule 7's waits: its plain limit holds "whatever the looks say", and a rank
        that outlives the others by it never exited (the job's work is done: nothing to
        restart), not a hang."""
        pace = step_seconds or 0.0
        return cls(
            confirm=max(CONFIRM, CONFIRM_STEPS * pace),
            all_waiting=max(ALL_WAITING, ALL_WAITING_STEPS * pace) if stepped else FIRST_COLLECTIVE,
            frozen_phase=hang_timeout if hang_timeout else OUTSIDE_LIMIT,
            finish_grace=min(FINISH_GRACE, hang_timeout) if hang_timeout else FINISH_GRACE,
            finished_working=min(OUTSIDE_LIMIT, hang_timeout) if hang_timeout else OUTSIDE_LIMIT,
        )


def effective(track: _RankTrack, now: float, limits: Limits) -> tuple[str, float] | None:
    """The rank's activity as the rules see it, and since when: a phase counts as work until
    the rank has stayed idle through it for the frozen-phase limit."""
    if track.kind_since is None:
        return None
    kind, since = track.kind_since
    if track.phase_seen is None or kind == STOPPED:
        return kind, since
    if kind == IDLE and now - since >= limits.frozen_phase:
        return IDLE, since
    return WORKING, track.phase_seen[1]


def judge(
    tracks: Mapping[int, _RankTrack],
    world_size: int,
    now: float,
    limits: Limits | None = None,
    finished_at: float | None = None,
) -> Hang | None:
    """The verdict over every rank's looks since the job went silent (rules 1-7)."""
    limits = limits or Limits(all_waiting=ALL_WAITING)
    current: dict[int, tuple[str, float, RankLook]] = {}
    for rank, track in tracks.items():
        seen = effective(track, now, limits)
        if seen is not None and track.looks:
            current[rank] = (seen[0], seen[1], track.looks[-1])
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
    for rank, track in sorted(tracks.items()):
        if track.phase_seen is None or not track.looks:
            continue
        name, since = track.phase_seen
        look = track.looks[-1]
        bound = look.phase_limit if look.phase_limit is not None else PHASE_LIMIT
        if now - since >= bound:
            return Hang(
                f"{look.host} rank {rank} has been in phase {name!r} for {now - since:.0f} s "
                f"(limit {bound:g} s; set it with phase(name, limit=S))",
                (f"{look.host} rank {rank}: in phase {name!r} at {look.where}",),
            )
    if finished_at is not None:
        # Only ranks seen since: the ones that finished are seen no more.
        current = {r: c for r, c in current.items() if c[2].at >= finished_at}
    if finished_at is not None and current:
        after = now - finished_at
        idle = [
            (r, look) for r, (kind, _, look) in current.items() if kind not in (WORKING, OUTSIDE)
        ]
        busy = [(r, look) for r, (kind, _, look) in current.items() if kind in (WORKING, OUTSIDE)]
        late = idle if after >= limits.finish_grace else []
        late += busy if after >= limits.finished_working else []
        if late:
            return Hang(
                f"finished, but {_ranks(sorted(late))} never exited ({after:.0f} s after the "
                f"first ranks finished; limit {limits.finish_grace:g} s, or "
                f"{limits.finished_working:g} s while working)",
                tuple(
                    f"{look.host} rank {r}: still running at {look.where} after the others finished"
                    for r, look in sorted(late)
                ),
                finished=True,
            )
        return None
    outside_long = [
        (r, look)
        for r, (kind, since, look) in current.items()
        if kind == OUTSIDE and now - since >= limits.outside
    ]
    if outside_long:
        return Hang(
            f"{_ranks(outside_long)} waited outside the job for "
            f"{max(now - current[r][1] for r, _ in outside_long):.0f} s "
            f"(limit {limits.outside:g} s)",
            tuple(
                f"{look.host} rank {r}: waiting on "
                f"{look.waits_outside or 'something that wakes it'} at {look.where}"
                for r, look in outside_long
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
    if any(k in (WORKING, OUTSIDE) for k, _, _ in current.values()):
        return None  # a rank works, or waits on the world: the others wait for it
    waiting = [(r, look) for r, (kind, _, look) in current.items() if kind == WAITING]
    idle = [
        (r, look)
        for r, (kind, since, look) in current.items()
        if kind == IDLE and now - since >= limits.confirm
    ]
    if waiting and idle:
        where = waiting[0][1].collective or waiting[0][1].where
        signs = "no CPU, no I/O, no wake-up, the same frames"
        if any(look.waits_for_loader for _, look in idle):  # the rank itself polls
            signs = "no CPU, no I/O, the same frames, in its data-loader worker too"
        return Hang(
            f"{_ranks(idle)} idle ({signs}) while the others wait in {where}",
            tuple(
                f"{look.host} rank {r}: blocked at {look.where} (no CPU, no I/O) while the "
                f"others wait in {where}"
                for r, look in idle
            ),
        )
    still = [tracks[r].still_since for r in current]
    if all(s is not None for s in still):
        nobody_for = now - max(s for s in still if s is not None)
        if nobody_for >= limits.all_waiting:
            return Hang(
                f"no rank has worked for {nobody_for:.0f} s: every rank waits or idles "
                f"(limit {limits.all_waiting:.0f} s)",
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
        self._phase_since: dict[int, float] = {}
        self._signalled = False
        self._paces: list[tuple[float, int]] = []
        """(when, highest step) each time the highest step rose: the job's pace."""
        self.finished_at: float | None = None
        """When ranks were first seen to finish while others ran (this clock)."""
        self._seen_on: dict[str, set[int]] = {}
        self._starts: dict[str, _StartTrack] = {}
        """Nodes none of whose ranks has been seen yet: their torchrun, look by look."""

    @property
    def enabled(self) -> bool:
        return self.timeout != 0

    def started(self) -> None:
        """A node's workers are starting: silence counts from now (a hang before the first
        step is found like any other). Until a rank has shown progress, from the last node's
        start: while herd is still starting nodes, the running ones wait at the rendezvous
        for them by design, and a look at them (every rank's stack on every node, again and
        again on a start that takes minutes) could only find that wait."""
        if self._since is None or not self._signalled:
            self._reset(self._clock())

    def signal(self, rank: int | None, step: int | None = None) -> None:
        """A rank showed progress (an output line, or a beat at ``step``)."""
        if rank is None:
            return
        now = self._clock()
        self._progress(rank, step, now)
        self._reset(now)

    def progressed(self, host: str, ranks: Iterable[tuple[int, int | None]]) -> None:
        """Ranks of ``host`` showed progress together (one report of the node: each rank's
        newest step, or None for a line): ``seen`` and ``signal`` for each, with one reading
        of the clock and one new silence for the lot (a thousand nodes' reports a few seconds
        apart are most of what the launcher does while a job runs)."""
        now = self._clock()
        seen = self._seen_on.setdefault(host, set())
        heard = False
        for rank, step in ranks:
            seen.add(rank)
            self._progress(rank, step, now)
            heard = True
        if heard:
            self._reset(now)

    def _progress(self, rank: int, step: int | None, now: float) -> None:
        self.last_signal[rank] = now
        self._signalled = True
        if step is not None and step >= self.steps.get(rank, -1):
            self.steps[rank] = step
            if not self._paces or step > self._paces[-1][1]:
                self._paces.append((now, step))
                del self._paces[:-20]

    def phase(self, rank: int | None, name: str | None) -> None:
        """A rank declared a long phase (or ended it: ``name`` None)."""
        if rank is None:
            return
        if name:
            if self.phases.get(rank) != name:
                self._phase_since[rank] = self._clock()
            self.phases[rank] = name
        else:
            self.phases.pop(rank, None)
            self._phase_since.pop(rank, None)
        self._reset(self._clock())

    def seen(self, host: str, rank: int) -> None:
        """``rank`` runs on ``host`` (it spoke or beat from there): a look from ``host``
        without it means it has exited."""
        self._seen_on.setdefault(host, set()).add(rank)

    def finished(self) -> None:
        """Some ranks finished (a node's workers all exited 0) while others may still run."""
        if self.finished_at is None:
            self.finished_at = self._clock()

    def step_seconds(self) -> float | None:
        """Seconds per step over the last steps seen, when known."""
        if len(self._paces) < 2:
            return None
        (t0, s0), (t1, s1) = self._paces[0], self._paces[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 and t1 > t0 else None

    def limits(self) -> Limits:
        """The windows for this job now (its pace, whether it has stepped, --hang-timeout)."""
        return Limits.for_pace(self.step_seconds(), bool(self.steps), self.timeout or None)

    def excuse(self, seconds: float) -> None:
        """This launcher did not run for ``seconds`` (stopped, suspended, starved): that time
        is not the job's silence, and looks taken before it are stale."""
        if self._since is not None:
            self._reset(self._since + seconds)

    def _reset(self, since: float) -> None:
        self._since = since
        self._tracks.clear()
        self._starts.clear()
        self._interval = LOOK_EVERY
        self._next_look = since + LOOK_AFTER

    @property
    def max_step(self) -> int | None:
        return max(self.steps.values()) if self.steps else None

    def silent_for(self) -> float:
        return 0.0 if self._since is None else self._clock() - self._since

    @property
    def progressed_yet(self) -> bool:
        """Whether a rank of the attempt has shown progress (a line or a beat)."""
        return self._signalled

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
        looks = RankLook.from_event(host, event, self._clock())
        here = {look.rank for look in looks}
        if self._seen_on.get(host, set()) - here:
            # A rank of this node left while the job runs on (torchrun itself waits for the
            # other nodes at its exit barrier, for minutes: its node does not end yet).
            self.finished()
        self._seen_on[host] = self._seen_on.get(host, set()) | here
        self._torchrun_looked(host, event)
        for look in looks:
            track = self._tracks.setdefault(look.rank, _RankTrack())
            previous = track.looks[-1] if track.looks else None
            if previous is not None and previous.pid != look.pid:
                track = self._tracks[look.rank] = _RankTrack()
                previous = None
            track.looks.append(look)
            del track.looks[:-3]
            if look.phase:
                if track.phase_seen is None or track.phase_seen[0] != look.phase:
                    since = self._phase_since.get(look.rank, look.at)
                    track.phase_seen = (look.phase, min(since, look.at))
            else:
                track.phase_seen = None
            if previous is None:
                if look.stopped:
                    track.kind_since = (STOPPED, look.at)
                continue
            kind = activity(previous, look)
            if track.kind_since is None or track.kind_since[0] != kind:
                track.kind_since = (kind, previous.at if kind != STOPPED else look.at)
            if kind in (WORKING, OUTSIDE):
                track.still_since = None
            elif track.still_since is None:
                track.still_since = previous.at
            unchanged = look.frames == previous.frames and not (
                look.io is not None
                and previous.io is not None
                and look.io - previous.io >= IO_MOVING
            )
            if not unchanged or look.phase or kind == OUTSIDE:
                track.same_frames_since = None
            elif track.same_frames_since is None:
                track.same_frames_since = previous.at
        kinds = {t.kind_since[0] for t in self._tracks.values() if t.kind_since}
        # Everyone at work: look less often. Anything else: keep looking closely.
        calm = bool(kinds) and kinds == {WORKING}
        self._interval = min(self._interval * 2, LOOK_EVERY_MAX) if calm else LOOK_EVERY

    def _torchrun_looked(self, host: str, event: Mapping[str, Any]) -> None:
        """Follow a node's torchrun while none of its ranks has been seen (rules 8, 9)."""
        seen = TorchrunLook.from_event(host, event, self._clock())
        if self._seen_on.get(host) or seen is None:
            self._starts.pop(host, None)
            return
        track = self._starts.get(host)
        if track is None or track.last.pid != seen.pid:
            self._starts[host] = _StartTrack(seen, seen.at if seen.stopped else None)
            return
        ticks = int(event.get("ticks") or 100)
        if not seen.stopped:
            track.stopped_since = None
        elif track.stopped_since is None:
            track.stopped_since = seen.at
        if seen.stopped or not seen.worked_since(track.last, ticks):
            track.still_since = track.last.at if track.still_since is None else track.still_since
        else:
            track.still_since = None
        track.last = seen

    def check(self) -> Hang | None:
        """The hang, if the job is hung (see the module docstring)."""
        if not self.enabled or self._since is None:
            return None
        silent = self._clock() - self._since
        plain_limit_passed = self.timeout is not None and self._signalled and silent > self.timeout
        if plain_limit_passed and self.finished_at is not None:
            # Others finished: the plain limit bounds rule 7's wait (limits()), whose verdict
            # names the ranks from the looks; the plain one only if no look could decide.
            return self._judged(silent) or self._never_exited(silent)
        if plain_limit_passed:
            inside = ", ".join(
                f"rank {r} in phase {name!r}" for r, name in sorted(self.phases.items())
            )
            return Hang(
                f"no progress from any rank for {silent:.0f} s (limit {self.timeout:g} s, set "
                f"by --hang-timeout){'; ' + inside if inside else ''}",
                self._places(),
                silent_for=silent,
            )
        started = judge_start(self._starts, sum(1 for ranks in self._seen_on.values() if ranks))
        if started is not None:
            return Hang(started.reason, started.behind, silent, node=started.node)
        return self._judged(silent)

    def _judged(self, silent: float) -> Hang | None:
        """The verdict of the rules on the ranks' looks, if any."""
        now = max((t.looks[-1].at for t in self._tracks.values() if t.looks), default=None)
        if now is None:
            return None
        found = judge(self._tracks, self.world_size, now, self.limits(), self.finished_at)
        if found is None:
            return None
        return Hang(found.reason, found.behind, silent, found.finished)

    def _never_exited(self, silent: float) -> Hang | None:
        """Rule 7 under the plain limit when the looks name no rank a confirmation after it
        (no look came, or none saw a rank still running)."""
        assert self.timeout is not None and self.finished_at is not None
        if self._clock() - self.finished_at < self.timeout + CONFIRM:
            return None
        return Hang(
            f"finished, but some ranks never exited ({silent:.0f} s without progress; limit "
            f"{self.timeout:g} s, set by --hang-timeout)",
            self._places(),
            silent_for=silent,
            finished=True,
        )

    def _places(self) -> tuple[str, ...]:
        """Where each rank was at the last look (for a verdict of the plain limit)."""
        lines = []
        for rank, track in sorted(self._tracks.items()):
            if not track.looks:
                continue
            look = track.looks[-1]
            kind = track.kind_since[0] if track.kind_since else "seen once"
            inside = f" in phase {look.phase!r}" if look.phase else ""
            lines.append(f"{look.host} rank {rank}: {kind}{inside} at {look.where}")
        return tuple(lines)
