"""A job's story from what herd kept of it: the record's attempts, the first failure, the
per-rank logs and stacks in the job directory, and the training metrics the script wrote.

Everything here reads files and tolerates what is missing: an older record without attempts,
keys a newer herd adds (shown as they are), a job whose script wrote no metrics.

Where the metrics are (``metrics.jsonl``, written by torchherd.train in its run directory),
in this order:

1. ``--metrics PATH`` (the file, or the run directory holding it);
2. the ``--run-dir`` (or ``--run_dir``) among the job's own arguments, taken from the job's
   working directory as the script took it;
3. a ``metrics.jsonl`` under the job's working directory (at most four levels down) that was
   written while the job ran, when exactly one such file is found; with two or more the page
   names them and asks for ``--metrics`` rather than guess.

Whatever the file, only the job's own records are kept: torchherd.train stamps each record
with the wall ``time`` it was written, and records written before the job started or after it
ended (an earlier run resumed in the same run directory, a later job writing there) are left
out. A file of records without times (an older trainer, a plain script) is judged by when it
was last written: during the job, not after (a later job in the same folder would otherwise
lend it its curves).
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..records import JobRecord

METRICS_FILE = "metrics.jsonl"
SEARCH_DEPTH = 4
# Directories a search for metrics.jsonl never enters: big, and never a run directory.
SKIPPED_DIRS = {".git", "__pycache__", "node_modules", ".venv", "venv", "snapshots", "tensorboard"}
# Slack at either end of the job's window for a record's time or a file's mtime: the workers'
# clocks against the launcher's, a flush racing the last exit. Not minutes: a job started soon
# after would fall inside it.
SLACK_S = 5.0


@dataclass
class Metrics:
    """Training records (step, loss, throughput) and where they came from."""

    path: Path | None
    found_by: str
    """How the file was found, or why there is none (said on the page)."""
    records: list[dict[str, Any]] = field(default_factory=list)

    def series(self, key: str) -> list[tuple[float, float]]:
        """(step, value) for every record that has a number under ``key``, in step order."""
        points = {}
        for record in self.records:
            step, value = record.get("step"), record.get(key)
            if isinstance(step, int | float) and isinstance(value, int | float):
                points[float(step)] = float(value)  # a step redone after a resume: the last
        return sorted(points.items())


@dataclass
class Story:
    """Everything the report page shows about one job."""

    record: JobRecord
    attempts: list[dict[str, Any]]
    metrics: Metrics
    rank_logs: list[Path]
    stacks: dict[str, list[Path]]
    """attempt directory name (attempt-N) -> its stack files."""
    made: float = field(default_factory=time.time)

    @property
    def first_failure(self) -> dict[str, Any] | None:
        """The job's first failure: the record's, else the first attempt that failed."""
        if self.record.first_failure:
            return self.record.first_failure
        for attempt in self.attempts:
            if isinstance(attempt.get("failure"), dict):
                failure: dict[str, Any] = attempt["failure"]
                return failure
        return None


def gather(record: JobRecord, metrics: str | None = None) -> Story:
    log_dir = Path(record.log_dir)
    stacks_root = log_dir / "stacks"
    stacks = {
        folder.name: sorted(folder.glob("*.txt"), key=_rank_order)
        for folder in sorted(stacks_root.glob("attempt-*"))
        if folder.is_dir()
    }
    return Story(
        record=record,
        attempts=[a for a in record.attempts if isinstance(a, dict)],
        metrics=find_metrics(record, metrics),
        rank_logs=sorted(log_dir.glob("rank-*.log"), key=_rank_order),
        stacks=stacks,
    )


def _rank_order(path: Path) -> tuple[int, str]:
    tail = path.stem.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else -1, path.name)


def workdir_of(record: JobRecord) -> Path | None:
    cluster = record.cluster or {}
    workdir = cluster.get("workdir") if isinstance(cluster, dict) else None
    return Path(os.path.expanduser(workdir)) if isinstance(workdir, str) and workdir else None


def run_dir_argument(what: str) -> str | None:
    """The value of --run-dir (or --run_dir) among the job's arguments, if any."""
    try:
        words = shlex.split(what)
    except ValueError:
        return None
    for i, word in enumerate(words):
        for option in ("--run-dir", "--run_dir"):
            if word == option and i + 1 < len(words):
                return words[i + 1]
            if word.startswith(option + "="):
                return word.split("=", 1)[1]
    return None


def find_metrics(record: JobRecord, given: str | None = None) -> Metrics:
    """The job's metrics (see the module's docstring for the order); empty with the reason
    when none are found."""
    if given:
        path = Path(given).expanduser()
        path = path / METRICS_FILE if path.is_dir() else path
        if not path.is_file():
            return Metrics(None, f"--metrics {given}: no {METRICS_FILE} there")
        return _own(record, path, "given with --metrics", strict=False)
    workdir = workdir_of(record)
    run_dir = run_dir_argument(record.what)
    if run_dir is not None:
        if "://" in run_dir and not run_dir.startswith("file://"):
            return Metrics(
                None,
                f"the run directory {run_dir} is not on this machine: copy its {METRICS_FILE} "
                "here and pass --metrics FILE",
            )
        base = Path(os.path.expanduser(run_dir.removeprefix("file://")))
        path = (base if base.is_absolute() or workdir is None else workdir / base) / METRICS_FILE
        if path.is_file():
            return _own(record, path, f"--run-dir {run_dir} in the job's arguments", strict=True)
    found = _written_during(record, workdir) if workdir is not None else []
    if len(found) == 1:
        return _own(record, found[0], "written under the job's working directory while it ran")
    if len(found) > 1:
        names = ", ".join(str(path) for path in found[:4])
        return Metrics(
            None,
            f"{len(found)} {METRICS_FILE} files were written while the job ran ({names}); "
            "herd does not guess which is this job's: pass --metrics PATH",
        )
    where = f"in {workdir}" if workdir else "for this job"
    return Metrics(
        None,
        f"no {METRICS_FILE} written while the job ran found {where} (torchherd.train writes "
        "one in its run directory; pass --metrics PATH if it is elsewhere)",
    )


def job_window(record: JobRecord) -> tuple[float, float]:
    """The wall times a record or file of this job can carry, slack included."""
    return record.started - SLACK_S, (record.ended or time.time()) + SLACK_S


def _own(record: JobRecord, path: Path, found_by: str, *, strict: bool = True) -> Metrics:
    """The file's records written while the job ran (all of them where none carries a time).
    ``strict``: a file with times but none in the job's window gives no curves (another job's);
    a file the user named is taken whole in that case, with a note."""
    records = read_metrics(path)
    start, end = job_window(record)
    timed = [r for r in records if isinstance(r.get("time"), int | float)]
    if not timed:
        return Metrics(path, found_by, records)
    own = [
        r
        for r in records
        if not isinstance(r.get("time"), int | float) or start <= r["time"] <= end
    ]
    left_out = len(timed) - sum(1 for r in own if isinstance(r.get("time"), int | float))
    if not any(isinstance(r.get("time"), int | float) for r in own):
        if strict:
            return Metrics(
                None,
                f"{path} ({found_by}) has no record written while this job ran: another job's "
                "run (pass --metrics PATH to draw it anyway)",
            )
        return Metrics(
            path, found_by + "; none of its records was written while this job ran", records
        )
    if left_out:
        found_by += f"; {left_out} record(s) written by other runs of the same directory left out"
    return Metrics(path, found_by, own)


def _written_during(record: JobRecord, workdir: Path) -> list[Path]:
    """Every metrics.jsonl under ``workdir`` written while the job ran: records stamped in the
    job's window, or (records without times) last modified in it."""
    start, end = job_window(record)
    found = []
    root_depth = len(workdir.parts)
    for folder, dirs, files in os.walk(workdir):
        depth = len(Path(folder).parts) - root_depth
        dirs[:] = [] if depth >= SEARCH_DEPTH else sorted(d for d in dirs if d not in SKIPPED_DIRS)
        if METRICS_FILE not in files:
            continue
        path = Path(folder) / METRICS_FILE
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if mtime < start:
            continue  # nothing written since the job started
        times = [r["time"] for r in read_metrics(path) if isinstance(r.get("time"), int | float)]
        if any(start <= t <= end for t in times) if times else mtime <= end:
            found.append(path)
    return found


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every JSON object line of the file; a torn or foreign line is skipped."""
    records = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            records.append(value)
    return records
