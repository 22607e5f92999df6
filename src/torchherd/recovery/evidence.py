"""Evidence before a kill: every reachable rank's stacks, kept on disk, and who is behind.

Before herd ends a job that is not exiting by itself (a hang, a lost node, a peer's failure),
it asks every live agent for its workers' Python stacks (py-spy). They are written under the
job directory as ``stacks/attempt-N/<host>-rank-R.txt`` with a ``summary.json``, and judged:

- a rank that is stopped (state T: SIGSTOP, a debugger, a frozen container) is behind;
- else, when most ranks wait in a collective, the ranks that do not are behind;
- else, ranks whose reported step is below the others' are behind.

``herd logs JOB --stacks`` prints what was kept.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import private_dir, write_private

# Frames of a thread that waits for other ranks: collectives, DDP's reducer inside backward,
# a work handle's wait, the store.
_COLLECTIVE = re.compile(
    r"\b(all_reduce|allreduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|barrier|"
    r"monitored_barrier|all_to_all\w*|_sync_\w+|backward|_engine_run_backward|wait|recv|send|"
    r"_store_based_barrier)\b"
)
_FRAME = re.compile(r"^\s+(\S+) \((.+)\)\s*$")


@dataclass(frozen=True)
class RankStack:
    """One worker's stacks as its agent sent them."""

    host: str
    rank: int
    local_rank: int
    pid: int
    state: str
    stack: str | None = None
    error: str | None = None
    children: tuple[dict[str, Any], ...] = ()
    """The rank's child processes (DataLoader workers...): pid, state, stack or error."""

    @property
    def main_frames(self) -> list[str]:
        """The main thread's frames, innermost first, as "function (file:line)"."""
        frames: list[str] = []
        in_main = False
        for line in (self.stack or "").splitlines():
            if line.startswith("Thread "):
                in_main = '"MainThread"' in line
                continue
            match = _FRAME.match(line)
            if in_main and match:
                frames.append(f"{match.group(1)} ({match.group(2)})")
        return frames

    @property
    def in_collective(self) -> bool:
        return any(_COLLECTIVE.search(frame.split(" ", 1)[0]) for frame in self.main_frames)

    @property
    def where(self) -> str:
        frames = self.main_frames
        return frames[0] if frames else "unknown"


@dataclass(frozen=True)
class Behind:
    """A rank herd names as the one holding the others up."""

    host: str
    rank: int
    why: str

    def line(self) -> str:
        return f"{self.host} rank {self.rank}: {self.why}"


def judge(stacks: Iterable[RankStack], steps: Mapping[int, int] | None = None) -> list[Behind]:
    """The ranks that are behind, by the rules in the module docstring."""
    ranks = sorted(stacks, key=lambda s: s.rank)
    steps = dict(steps or {})
    stopped = [s for s in ranks if s.state == "T"]
    if stopped:
        return [
            Behind(s.host, s.rank, f"stopped (state T: SIGSTOP, a debugger) at {s.where}")
            for s in stopped
        ]
    dumped = [s for s in ranks if s.stack]
    waiting = [s for s in dumped if s.in_collective]
    if dumped and len(waiting) * 2 >= len(dumped) and len(waiting) < len(dumped):
        where = waiting[0].where
        return [
            Behind(
                s.host,
                s.rank,
                f"not in a collective (at {s.where}) while the others wait in {where}",
            )
            for s in dumped
            if not s.in_collective
        ]
    known = {s.rank: steps[s.rank] for s in ranks if s.rank in steps}
    if len(set(known.values())) > 1:
        ahead = max(known.values())
        return [
            Behind(s.host, s.rank, f"at step {known[s.rank]} while others reached {ahead}")
            for s in ranks
            if s.rank in known and known[s.rank] < ahead
        ]
    return []


def _behind_fields(line: str) -> dict[str, Any]:
    match = re.match(r"(\S+) rank (\d+): (.*)$", line)
    if match is None:
        return {"host": "", "rank": None, "why": line}
    return {"host": match.group(1), "rank": int(match.group(2)), "why": match.group(3)}


class Evidence:
    """Stacks of one attempt, as they arrive from the agents, and where they are kept."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.stacks: list[RankStack] = []
        self.reasons: dict[str, str] = {}
        self.problems: list[str] = []

    def add(self, host: str, event: Mapping[str, Any]) -> None:
        """An agent's {"e": "stacks"} event."""
        self.reasons[host] = str(event.get("reason", ""))
        for worker in event.get("workers", []):
            try:
                self.stacks.append(
                    RankStack(
                        host=host,
                        rank=int(worker["rank"]),
                        local_rank=int(worker.get("local_rank", 0)),
                        pid=int(worker.get("pid", 0)),
                        state=str(worker.get("state", "?")),
                        stack=worker.get("stack"),
                        error=worker.get("error"),
                        children=tuple(
                            c for c in worker.get("children") or () if isinstance(c, dict)
                        ),
                    )
                )
            except (KeyError, TypeError, ValueError):
                continue
            if worker.get("error"):
                self.problems.append(f"{host} rank {worker.get('rank')}: {worker['error']}")

    def save(self, behind: list[str]) -> Path | None:
        """Write every rank's stacks and a summary (``behind``: "host rank R: why" lines);
        the directory, or None with nothing kept."""
        if not self.stacks:
            return None
        private_dir(self.directory)
        for item in self.stacks:
            text = item.stack if item.stack else f"no stacks: {item.error}\n"
            header = f"# {item.host} rank {item.rank} (local {item.local_rank}) pid {item.pid} "
            header += f"state {item.state}\n"
            write_private(self.directory / f"{item.host}-rank-{item.rank}.txt", header + text)
            for child in item.children:
                pid = int(child.get("pid", 0))
                said = child.get("stack") or f"no stacks: {child.get('error')}\n"
                write_private(
                    self.directory / f"{item.host}-rank-{item.rank}-child-{pid}.txt",
                    f"# {item.host} rank {item.rank}: child process {pid} of {item.pid} "
                    f"state {child.get('state', '?')}\n{said}",
                )
        summary = {
            "reasons": self.reasons,
            "behind": [_behind_fields(line) for line in behind],
            "ranks": [
                {
                    "host": s.host,
                    "rank": s.rank,
                    "pid": s.pid,
                    "state": s.state,
                    "in_collective": s.in_collective,
                    "where": s.where,
                    "error": s.error,
                }
                for s in sorted(self.stacks, key=lambda s: s.rank)
            ],
        }
        write_private(self.directory / "summary.json", json.dumps(summary, indent=2) + "\n")
        return self.directory
