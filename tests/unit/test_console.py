"""The launcher's console on a real pipe that nobody reads: worker lines never block, the queue
stays bounded, every line left out is counted and said, and close() returns in time."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from typing import TextIO

import pytest

from torchherd.console import Console

CAPACITY = 100
TOTAL = 5_000  # 5 MB of lines: far more than a pipe (64 KiB) and the queue can hold


class Pipe:
    """A real pipe: its read end (a descriptor nobody reads yet), its write end as a text
    stream for the console."""

    def __init__(self) -> None:
        self.read_fd: int | None
        self.read_fd, write_fd = os.pipe()
        self.stream: TextIO = os.fdopen(write_fd, "w")

    def close_read_end(self) -> None:
        if self.read_fd is not None:
            os.close(self.read_fd)
            self.read_fd = None

    def close(self) -> None:
        # The read end first: a writer blocked on the full pipe gets EPIPE and lets go of the
        # stream, which could not be closed under it otherwise.
        self.close_read_end()
        try:
            self.stream.close()
        except OSError:
            pass


@pytest.fixture
def pipe() -> Iterator[Pipe]:
    made = Pipe()
    try:
        yield made
    finally:
        made.close()


def in_thread(action: object, timeout: float) -> bool:
    """Run ``action`` in a thread; True if it returned within ``timeout`` seconds."""
    thread = threading.Thread(target=action, daemon=True)  # type: ignore[arg-type]
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()


def read_all(read_fd: int, into: list[bytes]) -> None:
    while chunk := os.read(read_fd, 1 << 16):
        into.append(chunk)


def test_a_console_nobody_reads_drops_lines_counts_them_and_says_so(pipe: Pipe) -> None:
    read_fd, stream = pipe.read_fd, pipe.stream
    assert read_fd is not None
    console = Console(stream, capacity=CAPACITY)
    lines = [f"line {i:05d} " + "x" * 990 for i in range(TOTAL)]
    waiting: list[int] = []

    def write_everything() -> None:
        for text in lines:
            console.write_line(text)
            waiting.append(console._queue.qsize())

    # Nobody reads: the writer thread blocks on the full pipe, the callers never do.
    assert in_thread(write_everything, 60), "write_line blocked on a console nobody reads"
    assert max(waiting) <= CAPACITY, max(waiting)  # bounded: the rest is counted, not kept

    received: list[bytes] = []
    reader = threading.Thread(target=read_all, args=(read_fd, received), daemon=True)
    reader.start()  # the console reads again
    console.note("herd: the end")
    console.close(timeout=30)
    stream.close()  # the console is closed: the reader sees the end
    reader.join(30)
    out = b"".join(received).decode().splitlines()

    shown = [line for line in out if line.startswith("line ")]
    notes = [line for line in out if "not shown" in line]
    counted = [
        int(n) for line in notes for n in re.findall(r"\[herd: (\d+) line\(s\) not shown", line)
    ]
    assert counted and len(counted) == len(notes), notes
    assert sum(counted) > 0
    assert len(shown) + sum(counted) == TOTAL, (len(shown), counted)
    assert shown == [line for line in lines if line in set(shown)]  # in order, none twice
    assert out[-1] == "herd: the end"  # herd's own words are never left out


def test_close_returns_in_time_on_a_console_that_never_reads_again(pipe: Pipe) -> None:
    console = Console(pipe.stream, capacity=CAPACITY)
    for i in range(TOTAL):
        console.write_line(f"line {i:05d} " + "x" * 990)
    console.note("herd: summary")
    started = time.monotonic()
    returned = in_thread(lambda: console.close(timeout=0.5), 30)
    took = time.monotonic() - started
    if not returned:
        pipe.close_read_end()  # let the stuck close() go before failing
    assert returned and took < 10, "close() waited for the reader"
    # The reader goes away for good: the blocked writer finds the pipe closed, drops the
    # console and ends; nothing raises in the launcher.
    pipe.close_read_end()
    console._thread.join(30)
    assert not console._thread.is_alive()
    assert console.gone
    console.write_line("after the end")  # ignored, not an error
    console.note("herd: after the end")


def test_close_waits_for_a_console_that_reads_slowly(pipe: Pipe) -> None:
    """A slow reader (a loaded terminal, a pipe into a slow program) with a backlog that takes
    longer than close()'s timeout to drain still gets every line or its count: close() gives
    up only on a console that has taken nothing for that long."""
    read_fd, stream = pipe.read_fd, pipe.stream
    assert read_fd is not None
    console = Console(stream, capacity=CAPACITY)
    lines = [f"line {i:05d} " + "x" * 990 for i in range(TOTAL)]
    assert in_thread(lambda: [console.write_line(text) for text in lines], 60)
    received: list[bytes] = []

    def read_slowly() -> None:
        while chunk := os.read(read_fd, 1 << 12):
            received.append(chunk)
            time.sleep(0.2)  # ~20 KB/s: the backlog (>= 100 KB) takes seconds, past the timeout

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    started = time.monotonic()
    console.close(timeout=0.5)
    assert time.monotonic() - started > 0.5  # it did wait past the timeout, reading went on
    assert not console._thread.is_alive(), "close() returned with lines still waiting"
    stream.close()
    reader.join(30)
    out = b"".join(received).decode().splitlines()
    shown = sum(line.startswith("line ") for line in out)
    counted = sum(int(n) for n in re.findall(r"\[herd: (\d+) line\(s\) not shown", "\n".join(out)))
    assert shown + counted == TOTAL, (shown, counted)
