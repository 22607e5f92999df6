"""Progress and control between a worker and its node agent, through small files (stdlib only).

A worker says "I made progress" with ``beat(step)``; herd's hang watch counts these besides the
worker's output lines, so a job that prints rarely is not taken for a hung one, and the evidence
gathered before a kill can say which rank fell behind. Herd asks workers to save a snapshot and
stop (a scheduler's time limit, a preemption) by a request file that ``save_requested()`` sees.

    worker  -- beat(step) -->  $HERD_PROGRESS_DIR/rank-R      (step and time, replaced atomically)
    agent   -- request  ---->  $HERD_PROGRESS_DIR/save-and-stop  (workers save, then exit 0)

Both are cheap enough to call every step: a beat writes at most twice a second, and the request
file is looked for at most once a second. Outside herd (no HERD_PROGRESS_DIR) both do nothing,
so a script that uses them runs unchanged under plain python or torchrun.

One line in any training loop::

    from torchherd.progress import beat; beat(step)
"""

from __future__ import annotations

import os
import time

PROGRESS_DIR_VAR = "HERD_PROGRESS_DIR"
SAVE_REQUEST = "save-and-stop"
# Seconds between writes of a rank's beat file, and between looks for the save request.
BEAT_EVERY = 0.5
LOOK_EVERY = 1.0

_last_beat = 0.0
_last_look = 0.0
_save_seen = False


def beat(step: int | None = None) -> None:
    """Tell herd this rank made progress (optionally at ``step``). No-op outside herd."""
    global _last_beat
    now = time.monotonic()
    if now - _last_beat < BEAT_EVERY:
        return
    directory = os.environ.get(PROGRESS_DIR_VAR)
    if not directory:
        return
    _last_beat = now
    rank = os.environ.get("RANK", "0")
    path = os.path.join(directory, f"rank-{rank}")
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w") as handle:
            handle.write(f"{'-' if step is None else int(step)} {time.time():.3f}\n")
        os.replace(temporary, path)
    except OSError:
        pass  # progress reports must never break training


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


# ------------------------------------------------------------------------------------------
# The agent's side


def read_beats(directory: str) -> dict[int, tuple[int | None, float]]:
    """Every rank's last beat on this node: rank -> (step or None, wall-clock time)."""
    beats: dict[int, tuple[int | None, float]] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return beats
    for name in names:
        if not name.startswith("rank-") or name.endswith(".tmp"):
            continue
        try:
            rank = int(name[5:])
            with open(os.path.join(directory, name)) as handle:
                step_text, when = handle.read().split()
            beats[rank] = (None if step_text == "-" else int(step_text), float(when))
        except (OSError, ValueError):
            continue  # half-written or foreign: the next look gets it
    return beats


def request_save(directory: str) -> None:
    """Ask every worker reading ``directory`` to save a snapshot and stop."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, SAVE_REQUEST), "w") as handle:
        handle.write(f"{time.time():.3f}\n")


__all__ = ["PROGRESS_DIR_VAR", "beat", "read_beats", "request_save", "save_requested"]
