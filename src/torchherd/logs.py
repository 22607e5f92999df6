"""Worker output: ``host:rank`` prefixes on the console, per-rank log files, the final summary.

The launcher does one thing per worker line: prefix it and write it (console and files). No
parsing, no buffering beyond the line, so thousands of lines per second stay cheap.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, TextIO

from .agent.protocol import readable_failure
from .console import Console
from .errors import EXIT_NEVER_EXITED
from .files import open_private, private_dir
from .noise import Chatter
from .records import herd_home
from .redact import redact_text
from .results import RunResult

if TYPE_CHECKING:
    import asyncio

# Seconds output may sit in buffers: lines reach a pipe, `herd logs` and the files this late at
# most (a running attempt flushes them every FLUSH_EVERY s), without a syscall per line.
FLUSH_EVERY = 0.2

# ANSI colours cycled per node on a terminal; plain text everywhere else.
_PALETTE = ("36", "33", "35", "32", "34", "91", "96", "93", "95", "92")
_DIM = "2"


class JobOutput:
    """Prints prefixed worker lines and keeps one log file per rank (plus one per node).

    Nothing here blocks the event loop that carries the agents' heartbeats: the console is
    written by a thread of its own (console.Console), the files by another (LogFiles), so a
    console that stops reading or a log disk that stalls (an NFS home) never delays a ping or
    a verdict. A file that cannot be written (a full disk) is noted once and left; the job
    goes on.
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
        hosts = list(hosts)
        self._colors = {host: _PALETTE[i % len(_PALETTE)] for i, host in enumerate(hosts)}
        self.width = max(len(h) for h in hosts) + 1 + len(str(max(world_size - 1, 0)))
        self._secrets = [s for s in secrets if s]
        self.files = LogFiles(log_dir, self.console)
        self.chatter = Chatter()
        """torch's known chatter, left out of the console (see torchherd.noise)."""
        self._first_line = threading.Event()
        self._first_line.set()  # nothing awaited until until_first_line()
        self._flushed = time.monotonic()
        self._unflushed = False
        """Something was written since the last flush (on an idle job of 32 nodes the two
        writer threads flushing 33 unchanged files were a third of the launcher's CPU)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop that flushes a write FLUSH_EVERY s after it (``flush_on``)."""

    def prefix(self, host: str, rank: int | None) -> str:
        label = f"{host}:{rank}" if rank is not None else host
        return label.ljust(self.width)

    def line(self, host: str, rank: int | None, text: str) -> None:
        self.lines(host, [(rank, text)])

    def lines(self, host: str, batch: Iterable[tuple[int | None, str]]) -> None:
        """Worker lines of one node (its agent sends them in batches): one hand-over to the
        console's thread and one to the files' for the whole batch."""
        self._first_line.set()
        shown: list[str] = []
        kept: list[tuple[str | None, str, str | None]] = []
        for rank, said in batch:
            text = redact_text(said, self._secrets) if self._secrets else said
            label = self.prefix(host, rank)
            wanted = self.ranks is None or rank is None or rank in self.ranks
            if wanted and self.chatter.shown(text):
                if self.color:
                    code = self._colors.get(host, "0") if rank is not None else _DIM
                    shown.append(f"\x1b[{code}m{label}\x1b[0m | {text}")
                else:
                    shown.append(f"{label} | {text}")
            name = f"rank-{rank}.log" if rank is not None else f"node-{host}.log"
            kept.append((name, f"{label} | {text}\n", text + "\n"))
        self.console.write_lines(shown)
        self.files.write_many(kept)
        self._written()

    def flush_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on a write not flushed at once is flushed FLUSH_EVERY s later by ``loop``,
        on whose thread every write comes (a running attempt's), and so is what was written
        before. A flush asked at the first write after a flush, not on a timer: an idle job's
        launcher does not wake up to find nothing to flush."""
        self._loop = loop
        if self._unflushed:
            loop.call_later(FLUSH_EVERY, self.flush)

    def _written(self) -> None:
        """Something was written: flushed now if the last flush is FLUSH_EVERY s old (a busy
        job), else at most FLUSH_EVERY s from now."""
        first = not self._unflushed
        self._unflushed = True
        if time.monotonic() - self._flushed > FLUSH_EVERY:
            self.flush()
        elif first and self._loop is not None:
            self._loop.call_later(FLUSH_EVERY, self.flush)

    def until_first_line(self, what: str) -> None:
        """On a terminal, a status line ("herd: starting the workers (4 s)") from now until the
        first worker line: the seconds between the banner and the first output otherwise look
        like a hang. Not written to a pipe or a file, nor to the logs."""
        if not self.stream.isatty():
            return
        self._first_line.clear()
        started = time.monotonic()

        def tick() -> None:
            while not self._first_line.wait(1.0):
                self.console.status(f"herd: {what} ({time.monotonic() - started:.0f} s)")
            self.console.status("")

        threading.Thread(target=tick, name="herd-status", daemon=True).start()

    def verdict_given(self) -> None:
        """herd has said how this attempt ends and is stopping it: from here the dying words
        of its ranks and agents go to the files only."""
        self.chatter.verdict()

    def attempt_started(self) -> None:
        """A new attempt: its lines matter again."""
        self.chatter.next_attempt()

    def note(self, text: str) -> None:
        """herd's own words (banner, restarts, summary): console and merged log."""
        if self._secrets:  # a summary quotes failure messages and stderr, which can hold them
            text = redact_text(text, self._secrets)
        self.console.note(text)
        self.console.flush()
        self.files.write(None, text + "\n", None)
        self._written()

    def flush(self) -> None:
        """Ask both writers to flush what was written since the last flush (nothing to ask
        when nothing was)."""
        self._flushed = time.monotonic()
        if not self._unflushed:
            return
        self._unflushed = False  # before the asks: a line written meanwhile asks again
        self.console.flush()
        self.files.flush()

    def close(self) -> None:
        self._first_line.set()
        self.flush()
        self.files.close()
        self.console.close()


class LogFiles:
    """The job's log files (``output.log`` and one file per rank), written by a thread.

    ``write`` never blocks: lines wait in a queue for the writer. If the disk is so slow that
    QUEUE_LINES lines wait, further lines are counted instead of kept (memory stays bounded)
    and the count is said once the writer catches up; a write that fails (a full disk) is said
    once, and the files are left alone from then on.
    """

    QUEUE_LINES = 200_000

    def __init__(self, log_dir: Path, console: Console) -> None:
        self.log_dir = log_dir
        self.console = console
        self.problem: str | None = None
        self.dropped = 0
        self._queue: queue.SimpleQueue[list[tuple[str | None, str, str | None]] | None | str] = (
            queue.SimpleQueue()
        )
        self._waiting = 0
        self._lock = threading.Lock()
        self._files: dict[str, IO[str]] = {}
        self._unflushed: set[str] = set()
        """The files written since the last flush (the writer thread's own): a flush leaves
        the others alone, which on a large job is most of them."""
        # Opened here, so a log directory that cannot be written fails the launch at once.
        self._merged = open_private(log_dir / "output.log")
        self._thread = threading.Thread(target=self._write, name="herd-logs", daemon=True)
        self._thread.start()

    def write(self, name: str | None, merged: str, own: str | None) -> None:
        """One line: ``merged`` for output.log, ``own`` for the file ``name`` (if any)."""
        self.write_many([(name, merged, own)])

    def write_many(self, lines: list[tuple[str | None, str, str | None]]) -> None:
        """Lines as ``write`` takes them, handed over at once."""
        if not lines:
            return
        with self._lock:
            if self._waiting >= self.QUEUE_LINES:
                self.dropped += len(lines)
                return
            self._waiting += len(lines)
        self._queue.put(lines)

    def flush(self) -> None:
        self._queue.put("flush")

    def close(self, timeout: float = 10.0) -> None:
        """Write what waits (for at most ``timeout`` s: a stalled disk must not keep herd
        from exiting), then close the files."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._safely(self._close_all)
                return
            if item == "flush":
                self._safely(self._flush_all)
                continue
            assert isinstance(item, list)
            with self._lock:
                self._waiting -= len(item)
                dropped, self.dropped = self.dropped, 0
            if dropped:
                self._say(
                    f"{dropped} line(s) could not wait for the log disk and are not in "
                    "the job's log files"
                )
            self._safely(functools.partial(self._keep_all, item))

    def _keep_all(self, lines: list[tuple[str | None, str, str | None]]) -> None:
        for name, merged, own in lines:
            self._merged.write(merged)
            if name is not None and own is not None:
                self._file(name).write(own)
                self._unflushed.add(name)

    def _file(self, name: str) -> IO[str]:
        handle = self._files.get(name)
        if handle is None:
            handle = open_private(self.log_dir / name)
            self._files[name] = handle
        return handle

    def _flush_all(self) -> None:
        self._merged.flush()
        for name in self._unflushed:
            self._files[name].flush()
        self._unflushed.clear()

    def _close_all(self) -> None:
        for handle in [*self._files.values(), self._merged]:
            try:
                handle.close()
            except OSError:
                pass

    def _safely(self, action: Callable[[], object]) -> None:
        """A write to the log files; a failure (disk full) is said once, and the job goes on."""
        if self.problem is not None:
            return
        try:
            action()
        except (OSError, ValueError) as exc:
            self.problem = str(exc)
            self._say(
                f"cannot write the job's logs in {self.log_dir}: {exc}; the job goes on, "
                "its output is shown here only"
            )

    def _say(self, text: str) -> None:
        self.console.note(f"herd: {text}")
        self.console.flush()


def render_summary(result: RunResult) -> str:
    """The closing block: status per node and the first failure with its last stderr lines."""
    state = {0: "succeeded", 130: "interrupted", 5: "saved a snapshot and stopped"}.get(
        result.exit_code, "failed"
    )
    after = f" after {result.restarts} restart(s)" if result.restarts else ""
    if result.exit_code == EXIT_NEVER_EXITED:
        state, after = "finished", f"{after}, but a rank never exited"
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
