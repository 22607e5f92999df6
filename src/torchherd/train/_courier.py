"""A tracker driven from a thread of its own, so that training never waits for it.

The training thread only appends to a bounded queue. The courier's thread opens the tracker's
run (which may take a while: a login, a lookup), sends whatever has gathered as one batch, and
on a failure (a tracking server down, a network outage, a bad token) reports once, keeps the
batch and tries again with growing pauses (1 s doubling to a minute); when it works again it
says so. The queue holds ``capacity`` records; past that the oldest are dropped, counted and
reported once (metrics.jsonl still has every step). ``close`` gives the thread ``deadline``
seconds to deliver what is left and end the run, then reports what was not sent and leaves
without it: a dead tracker never holds a finished job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from torchherd.train.trackers import Tracker

__all__ = ["Courier"]

log = logging.getLogger("torchherd.train")

CAPACITY = 100_000
FIRST_PAUSE = 1.0
LONGEST_PAUSE = 60.0
CLOSE_DEADLINE = 30.0

# Queue items: ("log", (step, values)), ("summary", values), ("close", finished)
Item = tuple[str, Any]


class Courier:
    """Sends one tracker's records from a background thread; see the module docstring."""

    def __init__(
        self,
        name: str,
        opener: Callable[[], Tracker],
        on_opened: Callable[[str, dict[str, Any]], None] | None = None,
        capacity: int = CAPACITY,
    ) -> None:
        self.name = name
        self._opener = opener
        self._on_opened = on_opened
        self._queue: deque[Item] = deque()
        self._capacity = capacity
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._finished = threading.Event()
        self.tracker: Tracker | None = None
        self.dropped = 0
        self.failures = 0
        """Failed attempts to open or send (each retried)."""
        self.last_error: str | None = None

    # ------------------------------------------------------------------ training thread

    def start(self) -> None:
        """Open the run and send from now on (records given before wait until then)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"tracker-{self.name}", daemon=True
            )
            self._thread.start()

    def log(self, step: int, values: dict[str, float]) -> None:
        self._put(("log", (step, values)))

    def summary(self, values: dict[str, Any]) -> None:
        self._put(("summary", values))

    def close(self, finished: bool, deadline: float = CLOSE_DEADLINE) -> bool:
        """Deliver what is queued and end the run, waiting at most ``deadline`` seconds.
        True when everything was delivered."""
        self._put(("close", finished))
        self.start()
        if not self._finished.wait(deadline):
            with self._ready:
                left = sum(1 for kind, _ in self._queue if kind == "log")
                self._closing = True  # the thread gives up at its next look
                self._ready.notify_all()
            log.warning(
                "%s: %d record(s) not sent within %.0fs (%s); leaving without them "
                "(metrics.jsonl has every step)",
                self.name,
                left,
                deadline,
                self.last_error or "no answer",
            )
            return False
        return True

    def _put(self, item: Item) -> None:
        with self._ready:
            if len(self._queue) >= self._capacity and item[0] == "log":
                self._queue.popleft()
                self.dropped += 1
                if self.dropped == 1:
                    log.warning(
                        "%s is not keeping up: dropping its oldest queued records "
                        "(metrics.jsonl has every step)",
                        self.name,
                    )
            self._queue.append(item)
            self._ready.notify()

    # ------------------------------------------------------------------ courier thread

    def _run(self) -> None:
        pause = FIRST_PAUSE
        while True:
            with self._ready:
                while not self._queue and not self._closing:
                    self._ready.wait()
                if self._closing:
                    return
                batch = list(self._queue)
                self._queue.clear()
            try:
                done = self._deliver(batch)
            except _Undelivered as undelivered:
                with self._ready:
                    self._queue.extendleft(reversed(batch[undelivered.sent :]))
                self._failed(undelivered.cause, pause)
                if self._wait_for(pause):
                    return
                pause = min(pause * 2, LONGEST_PAUSE)
                continue
            if self.failures and pause > FIRST_PAUSE:
                log.warning("%s works again; records held meanwhile are sent", self.name)
            pause = FIRST_PAUSE
            if done:
                self._finished.set()
                return

    def _deliver(self, batch: list[Item]) -> bool:
        """Send ``batch`` in order; True once the run was closed. Raises _Undelivered with
        how many items went through."""
        sent = 0
        try:
            if self.tracker is None:
                self.tracker = self._opener()
                if self._on_opened is not None:
                    self._on_opened(self.name, dict(self.tracker.identity))
            while sent < len(batch):
                kind, payload = batch[sent]
                if kind == "log":
                    end = sent
                    while end < len(batch) and batch[end][0] == "log":
                        end += 1
                    self.tracker.log([entry for _, entry in batch[sent:end]])
                    sent = end
                    continue
                if kind == "summary":
                    self.tracker.summary(payload)
                else:
                    self.tracker.close(bool(payload))
                    return True
                sent += 1
        except Exception as exc:  # noqa: BLE001 - any tracker failure is retried, never fatal
            raise _Undelivered(sent, exc) from exc
        return False

    def _failed(self, cause: BaseException, pause: float) -> None:
        self.failures += 1
        self.last_error = f"{cause.__class__.__name__}: {_first_line(cause)}"
        if self.failures == 1:
            log.warning(
                "%s failed (%s); training goes on, and records are kept and retried in the "
                "background (metrics.jsonl has every step)",
                self.name,
                self.last_error,
            )

    def _wait_for(self, pause: float) -> bool:
        """Sleep ``pause`` seconds unless told to give up; True when told."""
        deadline = time.monotonic() + pause
        with self._ready:
            while not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._ready.wait(left)
            return True


class _Undelivered(Exception):
    def __init__(self, sent: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.sent = sent
        self.cause = cause


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no message"
