"""What a job run ended as (RunResult) and the failure that caused the others (Failure).

Typed values handed from the launcher (launcher/outcome.py makes them) to whoever runs a job:
the CLI's summary (logs.render_summary), the job record, `herd bench` and the doctor's
measuring jobs. Nothing here does anything; it is the shape of the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Failure:
    """The first failure of a job: where, what, and the last words of the failing rank."""

    host: str
    rank: int | None
    exitcode: int | None
    signal: str | None
    message: str
    last_stderr: tuple[str, ...] = ()
    remedy: str = ""
    cause: str = ""
    """What the failure means, in words, when its signature is known (recovery.causes)."""

    def headline(self) -> str:
        where = f"{self.host} rank {self.rank}" if self.rank is not None else self.host
        where = where or "the job"
        if self.signal:
            how = f"killed by {self.signal}"
        elif self.exitcode is not None:
            how = f"exit code {self.exitcode}"
        else:
            how = self.message
        return f"{where}: {how}"


@dataclass
class RunResult:
    job_id: str
    exit_code: int
    node_status: dict[str, str] = field(default_factory=dict)
    """host -> succeeded, failed, stopped, lost, not started."""
    first_failure: Failure | None = None
    duration: float = 0.0
    log_dir: Path | None = None
    restarts: int = 0
    """Times the whole job was restarted after a failure."""
    behind: tuple[str, ...] = ()
    """The ranks herd found holding the others up, one line each (from their stacks)."""
    stacks_dir: Path | None = None
    """Where the workers' stacks taken before the kill are kept."""
    evidence_problems: tuple[str, ...] = ()
    hang: str | None = None
    """Why herd called the job hung, if it did."""
    lost: tuple[str, ...] = ()
    """Nodes that stopped answering."""
    max_step: int | None = None
    """The highest step any rank reported (torchherd.progress beats)."""
    reason: str = ""
    """One line on why herd gave up, when it did early (a crash loop, too few nodes)."""
