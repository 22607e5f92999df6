"""A running job's recent step times on this node, for `herd top` (standard library only).

Read from the ranks' own beat files (progress.py) in the newest attempt's progress directory on
this node, the files the node agent forwards to the launcher: no launcher, job record or log
needed, so a detached job and a job started from another machine show theirs too. One value per
sample in which some rank beat again: the node's slowest rank's work per step
(``step_times.beat_seconds``, what the report page's strips draw), the RECENT newest kept.
A job whose beats carry no timings (a plain script's ``beat(step)``) has none: its step rate
is in the PROGRESS column already.
"""

from __future__ import annotations

import glob
import os
import re
from collections import deque
from typing import Any

from .. import progress
from ..step_times import beat_seconds
from .attempt import progress_root

# Values kept per job: the sparkline's length in `herd top`.
RECENT = 24
ATTEMPT = re.compile(r"attempt-(\d+)$")


def newest_attempt_dir(job_id: str, node: str) -> str | None:
    """The progress directory of the job's newest attempt on this node, if it has one."""
    found = glob.glob(os.path.join(progress_root(), glob.escape(job_id), glob.escape(node), "*"))
    numbered = [(int(m.group(1)), path) for path in found if (m := ATTEMPT.search(path))]
    return max(numbered)[1] if numbered else None


class RecentStepTimes:
    """Per job, the last RECENT step times of this node, taken once a sample."""

    def __init__(self) -> None:
        self.values: dict[str, deque[float]] = {}
        self.measure: dict[str, str] = {}
        self._seen: dict[str, tuple[str, dict[int, float]]] = {}
        """job -> (its attempt's directory, rank -> the beat time last read)."""

    def take(self, job: dict[str, Any]) -> None:
        """Read the job's beats once; put ``step_times`` (seconds, oldest first) and
        ``step_time_measure`` into ``job`` when it has any."""
        job_id, node = str(job["job_id"]), str(job.get("node") or "")
        directory = newest_attempt_dir(job_id, node)
        if directory is None:
            return
        where, beats = self._seen.get(job_id, (directory, {}))
        if where != directory:  # a new attempt: its own beats, the old values kept
            beats = {}
        timed = []
        for rank, seen in progress.read_progress(directory).items():
            if seen.beat_at is None or beats.get(rank) == seen.beat_at:
                continue
            beats[rank] = seen.beat_at
            found = beat_seconds(seen.compute, seen.wait, seen.cycle)
            if found is not None:
                timed.append(found)
        self._seen[job_id] = (directory, beats)
        if timed:
            seconds, measure = max(timed)
            self.values.setdefault(job_id, deque(maxlen=RECENT)).append(round(seconds, 6))
            self.measure[job_id] = measure
        if self.values.get(job_id):
            job["step_times"] = list(self.values[job_id])
            job["step_time_measure"] = self.measure[job_id]
