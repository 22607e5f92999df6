"""Job records under ~/.herd/jobs/<id>/ (or $HERD_HOME/jobs/<id>/): what ps/logs/stop read.

A record never holds a secret: commands and environments are redacted before they are stored.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .files import private_dir, write_private


def herd_home() -> Path:
    return Path(os.path.expanduser(os.environ.get("HERD_HOME") or "~/.herd"))


def job_dir(job_id: str) -> Path:
    return herd_home() / "jobs" / job_id


@dataclass
class JobRecord:
    id: str
    state: str
    """running, succeeded, failed, stopped, saved, "finished, a rank never exited"."""
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
    lines_on_nodes: bool = False
    """Only some ranks' lines reached the launcher (a large job): the rest are kept on the
    nodes, where `herd logs JOB --rank R` reads them."""
    slow: str | None = None
    """The rank herd last named slow while the job ran (recovery.straggler), in words."""
    attempts: list[dict[str, Any]] = field(default_factory=list)
    """One entry per attempt, oldest first (see ``attempt_entry``): the job's story, which
    `herd report` draws as a timeline."""
    name: str | None = None
    """The user's name for the job (``herd launch --name``)."""
    what: str = ""
    """What ran: the script or module and its arguments (secrets masked)."""
    kind: str = "job"
    """"job" for a user's job; herd's own jobs (the doctor's all-reduce, benchmarks) say what
    they are, and `herd ps` lists them only with --all."""
    groups: list[dict[str, Any]] = field(default_factory=list)
    """A job run as replica groups (--replica-groups): each group's node, runs and outages
    (launcher/groups.py), the others' time to their next commit and the group's to heal."""

    def text(self) -> str:
        """The record as job.json holds it (taken where the record changes, then written): one
        field a line, each value in compact JSON. json's indented output is pure Python, and
        with dataclasses.asdict's deep copy it cost a 32-node launch a tenth of the launcher's
        CPU (the record is taken several times a launch and grows with the nodes); compact
        values go through json's C encoder, and the fields are plain JSON already."""
        entries = (
            f"  {json.dumps(f.name)}: {json.dumps(getattr(self, f.name))}" for f in fields(self)
        )
        return "{\n" + ",\n".join(entries) + "\n}\n"

    def save(self, text: str | None = None) -> None:
        directory = job_dir(self.id)
        private_dir(directory, home=herd_home())
        write_private(directory / "job.json", self.text() if text is None else text)


def attempt_entry(
    number: int,
    nodes: list[dict[str, Any]],
    world_size: int,
    rdzv_endpoint: str | None,
    *,
    how: str = "first",
    why: str = "",
) -> dict[str, Any]:
    """A new attempt's entry in ``JobRecord.attempts``. Keys filled while and after it runs:

    ``outcome`` (running, succeeded, failed, hung, lost, stopped, saved, interrupted,
    "finished, a rank never exited"),
    ``ended`` (wall time), ``noticed`` (how herd noticed the fault: "a worker exited",
    "the hang watch", "the node went silent", "the agent's link ended", ...), ``failure``
    (host, rank, exitcode, signal, message, cause, remedy), ``behind`` (lines naming the ranks
    that held the others up), ``stacks_dir``, ``max_step`` (highest step beaten).
    """
    return {
        "n": number,
        "started": time.time(),
        "ended": None,
        # Its own copies: what the attempt adds per node (rates, step times) is its alone,
        # not the job's list of nodes.
        "nodes": [dict(n) for n in nodes],
        "world_size": world_size,
        "rdzv_endpoint": rdzv_endpoint,
        "how": how,
        "why": why,
        "outcome": "running",
        "noticed": "",
        "failure": None,
        "behind": [],
        "stacks_dir": None,
        "max_step": None,
    }


def load_record(job_id: str) -> JobRecord | None:
    """The job's record; None when there is none, or (with a warning naming the file) when it
    cannot be read: one damaged record must not stop ps, logs or stop for every other job."""
    path = job_dir(job_id) / "job.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        _skip(path, str(exc))
        return None
    known = set(JobRecord.__dataclass_fields__)
    try:
        record = JobRecord(**{k: v for k, v in data.items() if k in known})
        _check_types(record)
    except (AttributeError, TypeError, ValueError) as exc:
        _skip(path, f"not a job record ({exc})")
        return None
    return record


_REQUIRED_TYPES: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "state": str,
    "started": (int, float),
    "source": str,
    "nodes": list,
    "world_size": int,
    "command": list,
    "log_dir": str,
    "launcher_pid": int,
}


def _check_types(record: JobRecord) -> None:
    for name, kind in _REQUIRED_TYPES.items():
        if not isinstance(getattr(record, name), kind):
            raise TypeError(f"{name} is {getattr(record, name)!r}")
    if not all(isinstance(n, dict) and isinstance(n.get("host"), str) for n in record.nodes):
        raise TypeError("nodes must list {host: ...} entries")


_warned: set[Path] = set()


def _skip(path: Path, why: str) -> None:
    if path in _warned:
        return
    _warned.add(path)
    print(
        f"warning: skipping the job record {path}: {why}\n"
        f"  fix: remove {path.parent} if that job is of no more use",
        file=sys.stderr,
    )


def list_records() -> list[JobRecord]:
    root = herd_home() / "jobs"
    if not root.is_dir():
        return []
    records = [load_record(entry.name) for entry in root.iterdir() if entry.is_dir()]
    return sorted((r for r in records if r is not None), key=lambda r: r.started)
