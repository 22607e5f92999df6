"""Worker output: ``host:rank`` prefixes on the console, per-rank log files, the final summary.

The launcher does one thing per worker line: prefix it and write it (console and files). No
parsing, no buffering beyond the line, so thousands of lines per second stay cheap.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

from .agent.protocol import readable_failure
from .console import Console
from .files import open_private, private_dir
from .jobs import herd_home
from .redact import redact_text

# Seconds output may sit in buffers: lines reach a pipe, `herd logs` and the files this late at
# most (the supervisor also flushes when the job goes quiet), without a syscall per line.
FLUSH_EVERY = 0.2

# ANSI colours cycled per node on a terminal; plain text everywhere else.
_PALETTE = ("36", "33", "35", "32", "34", "91", "96", "93", "95", "92")
_DIM = "2"


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


class JobOutput:
    """Prints prefixed worker lines and keeps one log file per rank (plus one per node).

    The console is written by a thread of its own (console.Console), so a console that stops
    reading never blocks the supervision; the files are written here. A file that cannot be
    written (a full disk) is noted once and left; the job goes on.
    """

    def __init__(
        self,
        log_dir: Path,
        hosts: Iterable[str],
        world_size: int,
        *,
        stream: TextIO | None = None,
        color: bool | None = None,
        secrets: Iterable[str] = (),
        ranks: Collection[int] | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.ranks = None if ranks is None else frozenset(ranks)
        """Global ranks whose lines reach the console (None: all); the files keep every rank."""
        private_dir(log_dir, home=herd_home())
        self.stream = stream or sys.stdout
        self.color = self.stream.isatty() if color is None else color
        self.console = Console(self.stream)
        self.ranks_seen: set[tuple[str, int]] = set()
        """(host, rank) of every rank that printed a line."""
        self._file_problem: str | None = None
        hosts = list(hosts)
        self._colors = {host: _PALETTE[i % len(_PALETTE)] for i, host in enumerate(hosts)}
        self.width = max(len(h) for h in hosts) + 1 + len(str(max(world_size - 1, 0)))
        self._secrets = [s for s in secrets if s]
        self._files: dict[str, IO[str]] = {}
        self._flushed = time.monotonic()
        # Open for the whole job, closed in close(): a with-block cannot span a job.
        self._merged = open_private(log_dir / "output.log")

    def prefix(self, host: str, rank: int | None) -> str:
        label = f"{host}:{rank}" if rank is not None else host
        return label.ljust(self.width)

    def line(self, host: str, rank: int | None, text: str) -> None:
        if self._secrets:
            text = redact_text(text, self._secrets)
        label = self.prefix(host, rank)
        if rank is not None:
            self.ranks_seen.add((host, rank))
        if self.color:
            code = self._colors.get(host, "0") if rank is not None else _DIM
            shown = f"\x1b[{code}m{label}\x1b[0m | {text}"
        else:
            shown = f"{label} | {text}"
        if self.ranks is None or rank is None or rank in self.ranks:
            self.console.write_line(shown)
        self._keep(lambda: self._merged.write(f"{label} | {text}\n"))
        self._keep(lambda: self._file(host, rank).write(text + "\n"))
        if time.monotonic() - self._flushed > FLUSH_EVERY:
            self.flush()

    def note(self, text: str) -> None:
        """herd's own words (banner, restarts, summary): console and merged log."""
        if self._secrets:  # a summary quotes failure messages and stderr, which can hold them
            text = redact_text(text, self._secrets)
        self.console.note(text)
        self.console.flush()
        self._keep(lambda: self._merged.write(text + "\n"))

    def flush(self) -> None:
        self._flushed = time.monotonic()
        self.console.flush()
        self._keep(self._merged.flush)
        for handle in self._files.values():
            self._keep(handle.flush)

    def _keep(self, write: Callable[[], object]) -> None:
        """A write to the log files; a failure (disk full) is said once, and the job goes on."""
        if self._file_problem is not None:
            return
        try:
            write()
        except (OSError, ValueError) as exc:
            self._file_problem = str(exc)
            self.console.note(
                f"herd: cannot write the job's logs in {self.log_dir}: {exc}; the job goes on, "
                "its output is shown here only"
            )

    def _file(self, host: str, rank: int | None) -> IO[str]:
        name = f"rank-{rank}.log" if rank is not None else f"node-{host}.log"
        handle = self._files.get(name)
        if handle is None:
            handle = open_private(self.log_dir / name)
            self._files[name] = handle
        return handle

    def close(self) -> None:
        self.flush()
        for handle in [*self._files.values(), self._merged]:
            try:
                handle.close()
            except OSError:
                pass
        self.console.close()


def render_summary(result: RunResult) -> str:
    """The closing block: status per node and the first failure with its last stderr lines."""
    state = {0: "succeeded", 130: "interrupted", 5: "saved a snapshot and stopped"}.get(
        result.exit_code, "failed"
    )
    after = f" after {result.restarts} restart(s)" if result.restarts else ""
    lines = [f"job {result.job_id} {state} in {result.duration:.1f} s{after}"]
    width = max((len(h) for h in result.node_status), default=0)
    for host, status in result.node_status.items():
        lines.append(f"  {host.ljust(width)}  {status}")
    failure = result.first_failure
    if failure is not None:
        lines.append(f"first failure: {failure.headline()}")
        # torch's @record error file arrives as JSON: its exception line and traceback.
        said, callstack = readable_failure(failure.message)
        if said and said not in failure.headline():
            lines.append(f"  {said}")
        shown = [text.strip() for text in failure.last_stderr[-10:]]
        if callstack and said.strip() not in shown:
            lines.append("  its traceback (recorded by torch's @record):")
            lines.extend(f"    {text}" for text in callstack.rstrip().splitlines()[-15:])
        if failure.last_stderr:
            lines.append("  last lines of its stderr:")
            lines.extend(f"    {text}" for text in failure.last_stderr[-10:])
        if failure.cause:
            lines.append(f"  cause: {failure.cause}")
        if failure.remedy:
            lines.append(f"  fix: {failure.remedy}")
    if result.behind:
        lines.append("behind (from the workers' stacks):")
        lines.extend(f"  {line}" for line in result.behind)
    if result.stacks_dir is not None:
        lines.append(f"stacks: {result.stacks_dir} (herd logs {result.job_id} --stacks)")
    for problem in result.evidence_problems:
        lines.append(f"  stacks missing: {problem}")
    if result.reason:
        lines.append(f"gave up: {result.reason}")
    if result.log_dir is not None:
        lines.append(f"logs: {result.log_dir}")
    return "\n".join(lines)
