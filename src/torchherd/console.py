"""The launcher's console: written from a thread of its own, never blocking the supervision.

A console that stops reading (`herd launch ... | less` left unread, Ctrl-S, a slow terminal)
must not stop the job: the event loop that carries the agents' heartbeats never writes to it.
Lines wait in a bounded queue for the writer thread; when the queue is full, new worker lines
are not shown (they are all in the log files) and, once the console reads again, a note says
how many were left out. herd's own notes always wait their turn. A console that is gone
(a closed pipe: `herd launch ... | head`) is dropped; the job and its logs go on.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import TextIO

# Lines that may wait for a slow console before worker lines are left out of it.
QUEUE_LINES = 10_000
_STOP = object()
# Back to the line's start, and clear it: a status line is replaced, never scrolled.
CLEAR_LINE = "\r\x1b[K"


class _Status(str):
    """A transient status line (a terminal's): written without a newline, cleared before the
    next thing written."""


class Console:
    """A TextIO written by a writer thread; ``write_line`` and ``note`` never block."""

    def __init__(self, stream: TextIO, capacity: int = QUEUE_LINES) -> None:
        self.stream = stream
        self._queue: queue.Queue[object] = queue.Queue()
        self._capacity = capacity
        self._dropped = 0
        self._waiting = 0
        """Worker lines queued and not yet written."""
        self._lock = threading.Lock()
        self._written = 0
        """Items written so far (close() waits while this grows)."""
        self.gone = False
        """True once the console could not be written (a closed pipe): it is not used again."""
        self._thread = threading.Thread(target=self._write, name="herd-console", daemon=True)
        self._thread.start()

    def write_line(self, text: str) -> None:
        """A worker line: shown unless the console is too far behind (then counted)."""
        self.write_lines([text])

    def write_lines(self, texts: list[str]) -> None:
        """Worker lines: shown unless the console is too far behind (then counted)."""
        if self.gone or not texts:
            return
        with self._lock:
            if self._waiting >= self._capacity:
                self._dropped += len(texts)
                return
            self._waiting += len(texts)
        self._queue.put(texts)

    def note(self, text: str) -> None:
        """herd's own words: never left out."""
        if not self.gone:
            self._queue.put(text)

    def status(self, text: str) -> None:
        """Show ``text`` as the status line (replacing the last; "" clears it). For terminals
        only: the caller asks only when the stream is one."""
        if not self.gone:
            self._queue.put(_Status(text))

    def flush(self) -> None:
        """Ask the writer to flush once it has written what waits (does not wait for it)."""
        if not self.gone:
            self._queue.put(None)

    def close(self, timeout: float = 5.0) -> None:
        """Write what waits, then stop the writer. A console that reads slowly gets every line
        (or its count); one that has taken nothing for ``timeout`` s is given up on: a console
        that never reads again must not keep herd from exiting."""
        self._queue.put(_STOP)
        written = -1
        while self._thread.is_alive() and self._written != written:
            written = self._written
            self._thread.join(timeout)

    def _write(self) -> None:
        shown = False  # a status line is on the screen
        while True:
            item = self._queue.get()
            if item is _STOP:
                if shown:
                    self._safely(lambda: self.stream.write(CLEAR_LINE))
                # Lines left out after the last line written are counted too.
                self._say_dropped()
                self._safely(self.stream.flush)
                return
            if self.gone:
                continue
            if isinstance(item, _Status):
                self._safely(lambda s=str(item): self.stream.write(CLEAR_LINE + s))
                self._safely(self.stream.flush)
                shown = bool(item)
                continue
            if shown and item is not None:
                self._safely(lambda: self.stream.write(CLEAR_LINE))
                shown = False
            self._say_dropped()
            text: str | None
            if isinstance(item, list):
                with self._lock:
                    self._waiting -= len(item)
                text = "\n".join(item)
            else:
                text = item if isinstance(item, str) else None  # a note, or a flush
            if text is not None:
                self._safely(lambda t=text: self.stream.write(f"{t}\n"))
                self._written += 1
            if item is None or self._queue.empty():
                self._safely(self.stream.flush)

    def _say_dropped(self) -> None:
        """The note for the worker lines left out since the last one (if any)."""
        if self.gone:
            return
        with self._lock:
            dropped, self._dropped = self._dropped, 0
        if dropped:
            self._safely(
                lambda: self.stream.write(
                    f"[herd: {dropped} line(s) not shown: the console did not keep up; "
                    "every line is in the job's output.log]\n"
                )
            )

    def _safely(self, action: object) -> None:
        try:
            action()  # type: ignore[operator]
        except (OSError, ValueError):  # a closed pipe or file: the console is gone
            self.gone = True
            _discard_from_now_on(self.stream)


def _discard_from_now_on(stream: TextIO) -> None:
    """Point a dead console's descriptor at /dev/null, so nothing written to it later (the
    interpreter's own flush at exit included) fails again."""
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, descriptor)
        os.close(null)
    except OSError:
        pass
