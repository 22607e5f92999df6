"""Job records under ~/.herd/jobs/<id>/ (or $HERD_HOME/jobs/<id>/): what ps/logs/stop read.

A record never holds a secret: commands and environments are redacted before they are stored.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def herd_home() -> Path:
    return Path(os.path.expanduser(os.environ.get("HERD_HOME") or "~/.herd"))


def job_dir(job_id: str) -> Path:
    return herd_home() / "jobs" / job_id


@dataclass
class JobRecord:
    id: str
    state: str
    """running, succeeded, failed, stopped."""
    started: float
    source: str
    nodes: list[dict[str, Any]]
    world_size: int
    command: list[str]
    rdzv_endpoint: str | None
    log_dir: str
    launcher_pid: int = field(default_factory=os.getpid)
    ended: float | None = None
    exit_code: int | None = None
    first_failure: dict[str, Any] | None = None
    cluster_file: str | None = None
    detached: bool = False
    cluster: dict[str, Any] | None = None
    """The cluster as launched (env redacted, paths absolute): stop/logs/ps reach the nodes
    from any directory, even when the cluster file has changed since."""
    node_dirs: dict[str, str] = field(default_factory=dict)
    """host -> the job's directory on that node (detached jobs: events.jsonl lives there)."""
    restarts: int = 0
    """Times the launcher restarted the whole job after a failure."""

    def save(self) -> None:
        directory = job_dir(self.id)
        directory.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".job.")
        with os.fdopen(descriptor, "w") as handle:
            json.dump(asdict(self), handle, indent=2)
        os.replace(temporary, directory / "job.json")


def load_record(job_id: str) -> JobRecord | None:
    try:
        data = json.loads((job_dir(job_id) / "job.json").read_text())
    except (OSError, ValueError):
        return None
    known = set(JobRecord.__dataclass_fields__)
    return JobRecord(**{k: v for k, v in data.items() if k in known})


def list_records() -> list[JobRecord]:
    root = herd_home() / "jobs"
    if not root.is_dir():
        return []
    records = [load_record(entry.name) for entry in root.iterdir() if entry.is_dir()]
    return sorted((r for r in records if r is not None), key=lambda r: r.started)
