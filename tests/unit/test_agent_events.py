"""What a node's agent says to the launcher in steady running, and what the launcher makes of it.

The launcher's work grows with the events it reads: a node of 8 ranks that beat once a second
sends one "beats" event a poll (not 8), and says "alive" only when it said nothing else lately.
Real progress files, the real agent emitter on a real pipe, the launcher's real Attempt.
"""

from __future__ import annotations

import importlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_first_failure import attempt_of
from torchherd import progress
from torchherd.agent import runner
from torchherd.agent.attempt import NodeAttempt


def beat_as(
    rank: int, step: int, monkeypatch: pytest.MonkeyPatch, compute: float, **waits: float
) -> None:
    """A worker of ``rank`` beats (a fresh progress module: a process of its own)."""
    monkeypatch.setenv("RANK", str(rank))
    importlib.reload(progress).beat(step, compute=compute, **waits)


@pytest.fixture
def node_attempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    events: list[dict[str, Any]] = []
    attempt = NodeAttempt({"job_id": "job", "node": "node1"}, events.append)
    attempt.progress_dir = str(tmp_path)
    monkeypatch.setenv(progress.PROGRESS_DIR_VAR, str(tmp_path))
    yield attempt, events
    importlib.reload(progress)


def test_every_ranks_new_beat_goes_in_one_event(node_attempt, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    attempt, events = node_attempt
    for rank in range(8):
        beat_as(rank, 5, monkeypatch, compute=0.1 * (rank + 1))
    attempt._send_progress()
    beats = [e for e in events if e["e"] == "beats"]
    assert len(beats) == 1, events
    assert sorted(item[0] for item in beats[0]["b"]) == list(range(8))
    assert {item[1] for item in beats[0]["b"]} == {5}
    assert [round(item[3], 2) for item in sorted(beats[0]["b"])][:2] == [0.1, 0.2]
    assert not any(e["e"] == "beat" for e in events)

    events.clear()
    attempt._send_progress()  # nothing new beaten: nothing sent
    assert [e for e in events if e["e"] == "beats"] == []

    beat_as(3, 6, monkeypatch, compute=0.5, wait=0.02, cycle=0.1, data=0.003)
    attempt._send_progress()
    [again] = [e["b"] for e in events if e["e"] == "beats"]
    # [rank, step, at, compute, wait, cycle, data]
    assert [(item[:2], item[3:]) for item in again] == [([3, 6], [0.5, 0.02, 0.1, 0.003])]


def test_the_launcher_takes_each_rank_of_a_beats_event(tmp_path: Path) -> None:
    attempt, output = attempt_of(tmp_path, ["n1", "n2"])
    node = attempt.state.nodes["n1"]
    attempt.events.handle(node, {"e": "beats", "b": [[0, 7, 100.0, 0.2], [1, 9, 100.0, None]]})
    attempt.events.handle(node, {"e": "beats", "b": [[0, 12, 102.0, 0.2], "junk", [None, 1, 2, 3]]})
    attempt.events.handle(node, {"e": "beats", "b": [[1, 13, 103.0, None, 0.03, 0.2, 0.004]]})
    output.close()
    assert attempt.hang.steps == {0: 12, 1: 13}
    # The node's step is its highest rank's, from its first report (9 at 100.0) to its last
    # (13 at 103.0).
    assert attempt.state.step_rates()["n1"] == (13, pytest.approx(4 / 3))
    assert attempt.slow.watch.reports_compute  # rank 0's compute times reached the watch
    assert list(attempt.slow.watch.times[("n1", 0)]) == [0.2, 0.2]
    assert ("n1", 1) not in attempt.slow.watch.times  # no compute reported: none counted
    assert attempt.slow.watch.beats_seen == {("n1", 1): 1}  # its wait, in the warm-up


class Stdout:
    """sys.stdout for the emitter: what it wrote, event by event."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()

    def events(self) -> list[str]:
        return [json.loads(line)["e"] for line in self.buffer.getvalue().splitlines()]


def test_alive_only_when_the_node_said_nothing_lately(monkeypatch: pytest.MonkeyPatch) -> None:
    out = Stdout()
    monkeypatch.setattr(sys, "stdout", out)
    clock = [1000.0]
    emit = runner.StdoutEmitter(on_broken=lambda: None, clock=lambda: clock[0])
    emit({"e": "alive"})  # nothing said yet
    clock[0] += runner.ALIVE_EVERY + 0.1
    emit({"e": "beats", "b": []})
    clock[0] += runner.ALIVE_EVERY - 0.5
    emit({"e": "alive"})  # the beats said it
    clock[0] += 0.6
    emit({"e": "alive"})  # silent for longer than ALIVE_EVERY: said
    assert emit.drain(5.0)
    assert out.events() == ["alive", "beats", "alive"]


def test_pings_often_enough_for_any_launcher_silence_and_rarely_on_defaults() -> None:
    from torchherd.launcher.attempt import AGENT_SILENCE, ping_every
    from torchherd.spec import ClusterSpec

    limits = ClusterSpec.model_fields["launcher_silence"].metadata
    lowest = next(m.ge for m in limits if hasattr(m, "ge"))
    highest = next(m.le for m in limits if hasattr(m, "le"))
    for silence in range(int(lowest), int(highest) + 1):
        # an agent hears at least two pings before it would take the launcher for gone
        assert silence / ping_every(silence) >= 2.5, silence
    assert ping_every(AGENT_SILENCE) == 10.0


def test_a_large_jobs_nodes_report_less_often_and_say_alive_no_more_often(tmp_path: Path) -> None:
    from torchherd.launcher.attempt import LARGE_JOB_NODES, agent_request
    from torchherd.recovery.liveness import SILENCE

    def request_for(nodes: int) -> dict[str, Any]:
        (tmp_path / str(nodes)).mkdir()
        attempt, output = attempt_of(tmp_path / str(nodes), [f"n{i}" for i in range(nodes)])
        output.close()
        return agent_request(attempt.plan, attempt.plan.nodes[0])

    small, large = request_for(LARGE_JOB_NODES), request_for(LARGE_JOB_NODES + 1)
    assert small["report_every"] == 1.0
    assert runner.alive_every(small) == runner.ALIVE_EVERY
    assert large["report_every"] > runner.ALIVE_EVERY
    assert runner.alive_every(large) == large["report_every"]
    # a node that says nothing else is still heard well within the launcher's silence limit
    assert 2 * runner.alive_every(large) < SILENCE


def test_agents_that_stopped_for_a_silent_launcher_explain_a_peers_failure(tmp_path: Path) -> None:
    """While the launcher was away the first agent to give up stopped its workers; the peer's
    worker failed on the reset before its own agent gave up. Whichever exit is read first, the
    attempt was stopped by its agents (restarted in place, not counted as a failure)."""
    attempt, output = attempt_of(tmp_path, ["n1", "n2"])
    failed = {"e": "exit", "code": 1, "failures": [{"rank": 0, "exitcode": 1}], "why": ""}
    attempt.events.handle(attempt.state.nodes["n1"], failed)
    assert attempt.state.ending and not attempt.state.stopped_for_silence
    silent = {"e": "exit", "code": 143, "stopped": True, "why": "launcher-silent"}
    attempt.events.handle(attempt.state.nodes["n2"], silent)
    output.close()
    assert attempt.state.stopped_for_silence
    assert "n2's agent stopped the job" in (tmp_path / "out").read_text()


def test_emitting_never_waits_on_a_link_nobody_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A partition closes nothing: the link's buffers fill and a write blocks for good. The
    agent must still be able to say it stops (and stop its workers): emitting never blocks."""
    import os
    import threading

    read_end, write_end = os.pipe()  # a real pipe whose reader never reads (until the end)
    writer = os.fdopen(write_end, "wb")

    class Link:
        buffer = writer

    monkeypatch.setattr(sys, "stdout", Link())
    emit = runner.StdoutEmitter(on_broken=lambda: None)
    big = "x" * 4096
    done = threading.Event()

    def flood() -> None:
        for index in range(200):  # 800 KiB: far more than a pipe (or a socket) holds
            emit({"e": "note", "i": index, "text": big})
        emit({"e": "exit", "code": 0})
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    try:
        assert done.wait(10.0), "emitting blocked on a link nobody reads"
        assert emit.pending() > 0  # the rest waits for the link, in the agent's memory
        # Once the link is read again, everything arrives, in order.
        received = b""
        while not received.endswith(b'"exit","code":0}\n') and len(received) < 2_000_000:
            received += os.read(read_end, 1 << 16)
        assert emit.drain(5.0)
        assert [json.loads(line)["e"] for line in received.splitlines()][-1] == "exit"
    finally:
        os.close(read_end)


def test_a_silent_launcher_stops_the_job_even_when_stderr_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent's stderr goes to the same cut link as its events: a full pipe blocks a write
    to it for good. The watch for a silent launcher must stop the attempt all the same."""
    import os
    import threading

    read_end, write_end = os.pipe()  # a real pipe nobody reads, filled to the brim
    os.set_blocking(write_end, False)
    try:
        while True:
            os.write(write_end, b"x" * 65536)
    except BlockingIOError:
        pass
    os.set_blocking(write_end, True)
    monkeypatch.setattr(sys, "stderr", os.fdopen(write_end, "w"))

    class Attempt:
        stop_requested = threading.Event()
        why = ""

        def request_stop(self, why: str = "asked", stacks_first: bool = False) -> None:
            self.why = why
            self.stop_requested.set()

    request = {"job_id": "j", "node": "node2", "heartbeat": 1.0, "silence": 1.0}
    agent = runner.Agent(request, lambda event: None, runner.Lines(io.BytesIO(b"")))
    attempt = Attempt()
    agent.current = attempt  # type: ignore[assignment]
    agent.last_heard -= 5.0  # five seconds without a word against a limit of one
    threading.Thread(target=agent.watch_launcher, daemon=True).start()
    try:
        assert attempt.stop_requested.wait(10.0), "a blocked stderr kept the job running"
        assert attempt.why == "launcher-silent"
    finally:
        agent.leaving.set()
        os.close(read_end)


def test_a_silent_launcher_also_ends_the_next_attempts_warm_wrapper(tmp_path: Path) -> None:
    """The agent that stops its attempt for a silent launcher lingers for it (LINGER), but
    not with the next attempt's wrapper warm: a real one (torch imported, hundreds of MB, the
    job's variables) would otherwise stay on a cut-off node for minutes."""
    import threading

    from torchherd.agent.attempt import Prewarmed

    class Attempt:
        stop_requested = threading.Event()

        def request_stop(self, why: str = "asked", stacks_first: bool = False) -> None:
            self.stop_requested.set()

    request = {"job_id": "j", "node": "node2", "heartbeat": 1.0, "silence": 1.0}
    agent = runner.Agent(request, lambda event: None, runner.Lines(io.BytesIO(b"")))
    spec = {"python": sys.executable, "workdir": str(tmp_path), "job_id": "j", "node": "node2"}
    warm = Prewarmed(spec | {"attempt": 1})
    agent.prewarmed = warm
    attempt = Attempt()
    agent.current = attempt  # type: ignore[assignment]
    agent.last_heard -= 5.0  # five seconds without a word against a limit of one
    threading.Thread(target=agent.watch_launcher, daemon=True).start()
    try:
        assert attempt.stop_requested.wait(10.0)
        deadline = time.monotonic() + 10.0
        while warm.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert warm.process.poll() is not None, "the warm wrapper outlived the stop"
        assert agent.prewarmed is None
    finally:
        agent.leaving.set()
        if warm.process.poll() is None:
            warm.discard()


def test_every_step_between_two_reports_counts_not_only_the_last_write(
    node_attempt, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The worker rewrites its beat file twice a second, the agent reads it once a second: a
    slowdown that comes and goes in step with the reads (a rank stopped for a sixth of every
    second) must still show, so the agent takes the mean of every step since its last read."""
    attempt, events = node_attempt
    monkeypatch.setenv("RANK", "0")
    worker = importlib.reload(progress)
    for wait in (0.01, 0.01):
        worker.beat(1, wait=wait, cycle=0.1, now=True)
    attempt._send_progress()
    # Three writes before the next read: the slow one (0.31) is not the last one.
    for wait in (0.01, 0.31, 0.01):
        time.sleep(0.002)  # a beat's time is kept to the millisecond
        worker.beat(2, wait=wait, cycle=0.1, now=True)
    events.clear()
    attempt._send_progress()
    [beats] = [e["b"] for e in events if e["e"] == "beats"]
    rank, step, _, compute, wait, cycle, data = beats[0]
    assert (rank, step, compute, data) == (0, 2, None, None)
    assert round(wait, 3) == 0.11 and round(cycle, 3) == 0.1  # (0.01 + 0.31 + 0.01) / 3


def test_lines_wait_for_a_slow_link_and_stop_waiting_for_a_stalled_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst larger than the agent's queue (one huge line, split into pieces) over a link
    that is slow but reading arrives whole: the lines wait for room instead of being dropped.
    A link that takes nothing holds them only LINK_STALLED seconds, then they are dropped and
    counted, as before."""
    import os
    import threading

    monkeypatch.setattr(runner, "OUT_MAX", 1 << 20)
    monkeypatch.setattr(runner, "LINES_WAIT_ABOVE", 1 << 19)
    monkeypatch.setattr(runner, "LINK_STALLED", 1.0)
    piece = "h" * 65536  # a piece of a huge line, as the agent splits it

    def link() -> tuple[int, Any]:
        read_end, write_end = os.pipe()
        return read_end, os.fdopen(write_end, "wb")

    # A slow reader: 64 KiB every 20 ms, far slower than the lines come.
    read_end, writer = link()
    emit = runner.StdoutEmitter(on_broken=lambda: None, stream=writer)
    received = bytearray()

    def read_slowly() -> None:
        while not received.endswith(b'"e":"exit"}\n'):
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                return
            received.extend(chunk)
            time.sleep(0.02)

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    for _ in range(64):  # 4 MiB of one rank's line: four times the queue
        emit({"e": "line", "r": 0, "l": 0, "s": "o", "t": piece})
    emit({"e": "exit"})
    reader.join(60)
    events = [json.loads(line) for line in bytes(received).splitlines()]
    assert "dropped" not in [event["e"] for event in events]
    arrived = sum(len(text) for event in events if event["e"] == "lines" for *_, text in event["b"])
    assert arrived == 64 * len(piece)
    os.close(read_end)

    # A link nobody reads: emitting goes on after LINK_STALLED, and what did not fit is counted.
    read_end, writer = link()
    emit = runner.StdoutEmitter(on_broken=lambda: None, stream=writer)
    done = threading.Event()

    def flood() -> None:
        for _ in range(64):
            emit({"e": "line", "r": 0, "l": 0, "s": "o", "t": piece})
        emit({"e": "exit"})
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    try:
        assert done.wait(30.0), "lines kept waiting for a link that took nothing"
        assert emit._dropped > 0
    finally:
        os.close(read_end)
