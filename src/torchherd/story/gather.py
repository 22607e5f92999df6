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
   written while the job ran: the newest such file.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..jobs import JobRecord

METRICS_FILE = "metrics.jsonl"
SEARCH_DEPTH = 4
# Directories a search for metrics.jsonl never enters: big, and never a run directory.
SKIPPED_DIRS = {".git", "__pycache__", "node_modules", ".venv", "venv", "snapshots", "tensorboard"}
# A metrics file written this long after the job's end still counts (a final upload, a flush).
LATE_WRITE_S = 120.0


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
        return Metrics(path, f"given with --metrics ({path})", read_metrics(path))
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
            return Metrics(path, f"--run-dir {run_dir} in the job's arguments", read_metrics(path))
    written = _written_during(record, workdir) if workdir is not None else None
    if written is not None:
        return Metrics(
            written,
            f"written under the job's working directory while it ran ({written})",
            read_metrics(written),
        )
    where = f"in {workdir}" if workdir else "for this job"
    return Metrics(
        None,
        f"no {METRICS_FILE} found {where} (torchherd.train writes one in its run directory; "
        "pass --metrics PATH if it is elsewhere)",
    )


def _written_during(record: JobRecord, workdir: Path) -> Path | None:
    """The newest metrics.jsonl under ``workdir`` modified while the job ran."""
    start = record.started - 5
    end = (record.ended or time.time()) + LATE_WRITE_S
    best: tuple[float, Path] | None = None
    root_depth = len(workdir.parts)
    for folder, dirs, files in os.walk(workdir):
        depth = len(Path(folder).parts) - root_depth
        dirs[:] = [] if depth >= SEARCH_DEPTH else [d for d in dirs if d not in SKIPPED_DIRS]
        if METRICS_FILE not in files:
            continue
        path = Path(folder) / METRICS_FILE
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if start <= mtime <= end and (best is None or mtime > best[0]):
            best = (mtime, path)
    return best[1] if best else None


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
