"""Progress and control between a worker and its node agent, through small files (stdlib only).

A worker tells herd what it is doing; herd's hang watch reads it besides the worker's output
lines and its process (stacks, CPU, I/O), so a job that prints rarely, compiles for ten minutes
or saves for five is never taken for a hung one:

    beat(step)           this rank made progress (the Trainer does every step)
    with phase("saving snapshot"): ...    (or phase("saving", limit=600))
                         a known long phase is under way on this rank (a save, a wait for a
                         background save, a resume, an upload): the rank counts as working
                         for at most ``limit`` seconds (PHASE_LIMIT when not given)
    saved(step, where)   a snapshot was committed (a time-limit stop ends with exit 5 only
                         once a snapshot committed after the request is confirmed)
    save_requested()     herd asks the workers to save a snapshot and stop (a time limit)

The files live in ``$HERD_PROGRESS_DIR``, a directory the node agent makes on node-local
storage (a runtime directory or tmpfs, never a shared home: a stalled NFS home must not freeze
training inside ``beat()``), new for every attempt, so an earlier attempt's beats are never
taken for fresh progress:

    rank-R          "<step or -> <wall time> [compute wait cycle data]"   beat(), replaced
                    atomically (each the mean seconds per step of the steps since the last
                    write that reported it, "-" where none did)
    rank-R.phase    "<wall time> <name>" [+ "\n<limit s>"]   while a phase runs; removed at
                                                       its end
    rank-R.saved    "<step> <wall time> <where>"       the last committed snapshot
    rank-R.start    "<mark> <wall time>" lines          the rank's start, mark by mark
                    (its interpreter, process-group init begun and done, its first beat)
    wrapper.start   the same, for torchrun's wrapper    ready: torch imported, torchrun runs
    save-and-stop   written by the agent               save_requested() looks for it

Every call is cheap enough for every step: a beat writes at most twice a second, the request
file is looked for at most once a second. Outside herd (no HERD_PROGRESS_DIR) every call does
nothing, so a script that uses them runs unchanged under plain python or torchrun.

One line in any training loop::

    from torchherd.progress import beat; beat(step)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

PROGRESS_DIR_VAR = "HERD_PROGRESS_DIR"
SAVE_REQUEST = "save-and-stop"
PHASE_SUFFIX = ".phase"
SAVED_SUFFIX = ".saved"
START_SUFFIX = ".start"
WRAPPER_MARKS = "wrapper" + START_SUFFIX
# Seconds a declared phase keeps a rank counted as working when the script gives no limit
# (the launcher's hang watch enforces it; see recovery.hang).
PHASE_LIMIT = 1800.0
# Seconds between writes of a rank's beat file, and between looks for the save request.
BEAT_EVERY = 0.5
LOOK_EVERY = 1.0

_last_beat = 0.0
_last_step: int | None = None
# The step timings beaten since the last write (see beat()): name -> [sum of seconds, steps].
TIMINGS = ("compute", "wait", "cycle", "data")
_timing_sums: dict[str, list[float]] = {}
# The same, since the rank's first beat: the agent reads the file less often than it is
# written, and takes the mean of every step between its reads from the difference.
_timing_totals: dict[str, list[float]] = {}
_last_look = 0.0
_save_seen = False
_phases: list[str] = []
_phase_lock = threading.Lock()
_first_beat_marked = False
# Whether the script beat timings of its own (the Trainer does): DDP's are then not used.
_script_times = False


def _path(suffix: str = "") -> str | None:
    directory = os.environ.get(PROGRESS_DIR_VAR)
    if not directory:
        return None
    return os.path.join(directory, f"rank-{os.environ.get('RANK', '0')}{suffix}")


def _replace(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically; never raise (progress must not break training)."""
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(temporary, "w") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except OSError:
        try:
            os.unlink(temporary)
        except OSError:
            pass


def beat(
    step: int | None = None,
    compute: float | None = None,
    now: bool = False,
    *,
    wait: float | None = None,
    cycle: float | None = None,
    data: float | None = None,
) -> None:
    """Tell herd this rank made progress (optionally at ``step``). A beat without a step
    keeps the last step given: a phase's end must not hide how far the rank got. Beats are
    written at most every ``BEAT_EVERY`` seconds unless ``now`` (the end of a phase, which is
    rare). No-op outside herd.

    What the rank's last step took, for herd's slow-rank watch (each optional, in seconds):
    ``compute`` its forward passes, in which it waits for no one; ``wait`` the time it was
    blocked on the other ranks (the gradients' all-reduce after its own backward was done);
    ``cycle`` the whole step, from the end of one step's all-reduce to the next; ``data``
    the time it waited for its data loader. The rank the others wait for is the one that
    waits least.

    The file carries the mean of every step since the last write, not the last step's
    alone: a rank slowed in bursts (a CPU quota pauses it for 70 ms of every 100 ms,
    wherever in the step it happens to be) shows in the mean of its steps, while one step
    in five lands on a pause only by chance."""
    global _script_times
    if wait is not None or cycle is not None:
        _script_times = True  # the script times its own steps: ddp_timing stands aside
    _beat(step, compute, now, wait=wait, cycle=cycle, data=data)


def ddp_timed(wait: float, cycle: float) -> None:
    """One DDP iteration's timings, read by ``ddp_timing`` for a script that times nothing
    itself (never the Trainer, which does: the first beat with its own waits ends these)."""
    if not _script_times:
        _beat(None, None, False, wait=wait, cycle=cycle)


def _beat(
    step: int | None,
    compute: float | None,
    now: bool,
    *,
    wait: float | None,
    cycle: float | None,
    data: float | None = None,
) -> None:
    global _last_beat, _last_step, _first_beat_marked
    if step is not None and not _first_beat_marked:
        # The end of the start (startup.py): the first beat with a step (a phase's end beats
        # without one, and may come before any step).
        _first_beat_marked = True
        mark("first-step")
    if step is not None:
        _last_step = int(step)
    for name, seconds in (("compute", compute), ("wait", wait), ("cycle", cycle), ("data", data)):
        if seconds is not None:
            for table in (_timing_sums, _timing_totals):
                total = table.setdefault(name, [0.0, 0])
                total[0] += seconds
                total[1] += 1
    moment = time.monotonic()
    if not now and moment - _last_beat < BEAT_EVERY:
        return
    path = _path()
    if path is None:
        return
    _last_beat = moment
    work = ""
    if _timing_totals:
        means = [_timing_sums.get(name) for name in TIMINGS]
        work = "".join(" -" if m is None else f" {m[0] / m[1]:.6f}" for m in means)
        totals = [_timing_totals.get(name) for name in TIMINGS]
        work += "".join(" -" if t is None else f" {t[0]:.6f}/{int(t[1])}" for t in totals)
        _timing_sums.clear()
    _replace(path, f"{'-' if _last_step is None else _last_step} {time.time():.3f}{work}\n")


@contextlib.contextmanager
def phase(name: str, limit: float | None = None) -> Iterator[None]:
    """Mark a known long phase of this rank's training loop (a save, a resume, a wait for a
    background save): while it runs the rank counts as working, whatever its stacks show, for
    at most ``limit`` seconds (PHASE_LIMIT, 30 minutes, when not given).

    Phases nest (the outermost one is shown, with its limit). Use it around code the training
    loop waits for; a background thread's own work needs none. A phase is no blank cheque: a
    rank stopped by a signal or a debugger is still a hang, ``--hang-timeout`` still applies,
    and a rank that shows no CPU, no I/O, no frame change and no wake-up for the hang limit is
    judged like any other. No-op outside herd.
    """
    path = _path(PHASE_SUFFIX)
    if path is None:
        yield
        return
    with _phase_lock:
        _phases.append(name)
        outermost = _phases[0]
        if len(_phases) == 1:
            bound = "" if limit is None else f"{float(limit):g}\n"
            _replace(path, f"{time.time():.3f} {_one_line(outermost)}\n{bound}")
    try:
        yield
    finally:
        with _phase_lock:
            _phases.pop()
            if not _phases:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        beat(now=True)  # the phase's end is progress too (and carries the newest step)


def mark(name: str, *, wrapper: bool = False) -> None:
    """Note that this rank (or, with ``wrapper``, torchrun's wrapper) reached a moment of its
    start: one line appended to its ``.start`` file. A few calls per attempt, never per
    step; the node's agent reads them until the first step (the launcher's start phases).
    No-op outside herd; never raises."""
    directory = os.environ.get(PROGRESS_DIR_VAR)
    if not directory:
        return
    path = os.path.join(directory, WRAPPER_MARKS) if wrapper else _path(START_SUFFIX)
    try:
        with open(path, "a") as handle:  # type: ignore[arg-type]
            handle.write(f"{_one_line(name)} {time.time():.4f}\n")
    except (OSError, TypeError):
        pass


def read_marks(directory: str) -> dict[str, dict[str, float]]:
    """Every ``.start`` file on this node: "wrapper" or the rank -> {mark: wall time}."""
    found: dict[str, dict[str, float]] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return found
    for name in names:
        if not name.endswith(START_SUFFIX):
            continue
        who = name[: -len(START_SUFFIX)].removeprefix("rank-")
        try:
            with open(os.path.join(directory, name)) as handle:
                text = handle.read()
        except OSError:
            continue
        marks = found.setdefault(who, {})
        for line in text.splitlines():
            label, _, when = line.rpartition(" ")
            try:
                marks.setdefault(label, float(when))  # the first time a mark was reached
            except ValueError:
                continue  # half-written: the next look gets it
    return found


def saved(step: int, where: str = "") -> None:
    """Tell herd a snapshot at ``step`` was committed (written completely, ``latest`` moved).
    No-op outside herd."""
    path = _path(SAVED_SUFFIX)
    if path is not None:
        _replace(path, f"{int(step)} {time.time():.3f} {_one_line(where)}\n")


def save_requested() -> bool:
    """True once herd asked the workers to save a snapshot and stop (time limit, preemption)."""
    global _last_look, _save_seen
    if _save_seen:
        return True
    now = time.monotonic()
    if now - _last_look < LOOK_EVERY:
        return False
    _last_look = now
    directory = os.environ.get(PROGRESS_DIR_VAR)
    _save_seen = directory is not None and os.path.exists(os.path.join(directory, SAVE_REQUEST))
    return _save_seen


def _one_line(text: str) -> str:
    return " ".join(text.split())[:200]


# ------------------------------------------------------------------------------------------
# The agent's side


@dataclass(frozen=True)
class RankProgress:
    """What one rank's files say: its last beat, its phase, its last committed snapshot."""

    step: int | None = None
    beat_at: float | None = None
    """Wall-clock time of the last beat (None: never beat)."""
    compute: float | None = None
    """Seconds the rank computed in the step it last beat for, when it said."""
    wait: float | None = None
    """Seconds per step it was blocked on the other ranks, when it said (see beat())."""
    cycle: float | None = None
    """Seconds per whole step, when it said."""
    data: float | None = None
    """Seconds per step it waited for its data loader, when it said."""
    totals: tuple[tuple[float, int] | None, ...] = ()
    """compute, wait, cycle and data since the rank's first beat: (seconds, steps) each, or
    None where it never said (``mean_since`` gives the means between two reads)."""
    phase: str | None = None
    phase_since: float | None = None
    phase_limit: float | None = None
    """Seconds the phase may last, when the script said."""
    saved_step: int | None = None
    saved_at: float | None = None
    saved_where: str = ""


def read_progress(directory: str) -> dict[int, RankProgress]:
    """Every rank's progress files on this node: rank -> RankProgress."""
    found: dict[int, dict[str, object]] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    for name in names:
        if not name.startswith("rank-") or name.endswith(".tmp"):
            continue
        stem, _, suffix = name[5:].partition(".")
        if "." + suffix == START_SUFFIX:
            continue  # read_marks' (only until the first step)
        try:
            rank = int(stem)
            with open(os.path.join(directory, name)) as handle:
                text = handle.read().strip()
            fields = found.setdefault(rank, {})
            if not suffix:
                step_text, when, *work = text.split()
                fields["step"] = None if step_text == "-" else int(step_text)
                fields["beat_at"] = float(when)
                for name, value in zip(TIMINGS, work, strict=False):
                    fields[name] = None if value == "-" else float(value)
                fields["totals"] = tuple(_total(value) for value in work[len(TIMINGS) :])
            elif "." + suffix == PHASE_SUFFIX:
                head, _, bound = text.partition("\n")
                since, _, label = head.partition(" ")
                fields["phase_since"], fields["phase"] = float(since), label
                if bound.strip():
                    fields["phase_limit"] = float(bound)
            elif "." + suffix == SAVED_SUFFIX:
                step_text, when, *where = text.split(" ", 2)
                fields["saved_step"], fields["saved_at"] = int(step_text), float(when)
                fields["saved_where"] = where[0] if where else ""
        except (OSError, ValueError):
            continue  # half-written or foreign: the next look gets it
    return {rank: RankProgress(**fields) for rank, fields in found.items()}  # type: ignore[arg-type]


def _total(text: str) -> tuple[float, int] | None:
    if text == "-":
        return None
    seconds, _, steps = text.partition("/")
    return float(seconds), int(steps)


def mean_since(
    now: tuple[tuple[float, int] | None, ...], before: tuple[tuple[float, int] | None, ...]
) -> list[float | None]:
    """compute, wait, cycle and data per step over the steps between two reads of a rank's
    totals (None where no step said it meanwhile)."""
    means: list[float | None] = []
    for index in range(len(TIMINGS)):
        total = now[index] if index < len(now) else None
        earlier = before[index] if index < len(before) else None
        seconds, steps = earlier or (0.0, 0)
        if total is not None and (
            total[1] < steps or (total[1] == steps and round(total[0] - seconds, 6))
        ):
            # Counted from zero again (fewer steps, or as many with other seconds, which one
            # process never writes): a process of its own.
            seconds, steps = 0.0, 0
        if total is None or total[1] <= steps:
            means.append(None)
        else:
            means.append((total[0] - seconds) / (total[1] - steps))
    return means


def read_beats(directory: str) -> dict[int, tuple[int | None, float]]:
    """Every rank's last beat on this node: rank -> (step or None, wall-clock time)."""
    return {
        rank: (p.step, p.beat_at)
        for rank, p in read_progress(directory).items()
        if p.beat_at is not None
    }


def request_save(directory: str) -> None:
    """Ask every worker reading ``directory`` to save a snapshot and stop."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, SAVE_REQUEST), "w") as handle:
        handle.write(f"{time.time():.3f}\n")


__all__ = [
    "PHASE_LIMIT",
    "PROGRESS_DIR_VAR",
    "RankProgress",
    "beat",
    "mark",
    "phase",
    "read_beats",
    "read_marks",
    "mean_since",
    "read_progress",
    "request_save",
    "save_requested",
    "saved",
]
