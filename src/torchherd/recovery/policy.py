"""Decisions after a failed attempt: restart the whole job, go on with fewer nodes, or stop.

herd restarts, not torchrun (torchrun counts restarts per node and desynchronises the store
prefixes): every node stops and the whole job starts again with a fresh rendezvous. The
budget (``max_restarts``) counts per job, never per node. When nodes were lost and at least
``min_nodes`` answer again, the job restarts on those (the first of them hosts the new
rendezvous). ``crash_loop`` restarts in a row without step progress end the job early.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import EXIT_JOB_FAILED

# An attempt without step information that ran this long counts as progress (a plain script
# that prints no step numbers and fails after an hour is not crash-looping).
PROGRESS_BY_TIME = 300.0


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 0
    """Times the whole job is restarted after a failure."""
    min_nodes: int | None = None
    """Go on without lost nodes while at least this many remain (None: every node needed)."""
    crash_loop: int = 3
    """Restarts in a row without step progress after which herd gives up (exit 4)."""

    def should_restart(self, exit_code: int, restarts_done: int) -> bool:
        # Only a job that ran and failed; never one interrupted or saved for a time limit.
        return exit_code == EXIT_JOB_FAILED and restarts_done < self.max_restarts

    def enough_nodes(self, alive: int, total: int) -> bool:
        needed = total if self.min_nodes is None else self.min_nodes
        return alive >= max(1, needed)


def made_progress(best_before: int | None, best_now: int | None, seconds: float) -> bool:
    """Whether an attempt moved the job forward: a higher step than any attempt before it, or,
    without step numbers at all, a long enough run."""
    if best_now is not None:
        return best_before is None or best_now > best_before
    return best_before is None and seconds >= PROGRESS_BY_TIME
