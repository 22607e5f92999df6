"""`python -m torchherd.agent run`: one node's agent for a job, serving its attempts.

The launcher opens one agent per node and keeps it as long as the node stays in the job, so a
restart with every node still answering costs no new session, no new agent and no cold torch
import (a wrapper for the next attempt is warmed while the last one stops). A request with
``"serve": true`` keeps the agent for further attempts; without it the agent exits once its
attempt has ended. The agent reads the launcher's lines on stdin and answers with events on
stdout, as agent/protocol.py describes them (its docstring is the protocol's one description).
It says {"e": "alive"} every alive_every() seconds for as long as it runs, stopping included,
so a node that stops slowly is never taken for a lost one (unless it said something else
lately: any event is as good). The launcher pings; when it has been silent for the request's
``silence`` seconds (a partition closes nothing; the launcher may be stopped or suspended), the
agent ends the attempt ("launcher-silent") and waits LINGER seconds for the launcher to come
back before it exits. SIGTERM, SIGINT or SIGHUP (`herd stop`) end the attempt and the agent.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .attempt import NodeAttempt, Prewarmed, herd_home
from .look import look_event
from .protocol import encode

__all__ = ["Agent", "NodeAttempt", "Prewarmed", "herd_home", "main"]

# Commands that act on one attempt: with an "attempt" field, only that attempt's (agent
# commands never reach the previous attempt, nor start the next one early).
ATTEMPT_COMMANDS = ("stop", "kill", "save", "stacks", "look")


def _attempt_number(value: object) -> int:
    try:
        return int(str(value))
    except ValueError:
        return -1


# Seconds between the agent's own "alive" events (at least; see alive_every).
ALIVE_EVERY = 2.0
# Seconds without a word from the launcher after which the agent ends the current attempt,
# when the request does not say: long enough for a launcher stalled by a blocked write, a
# Ctrl-Z or a paused VM to come back (say a minute), short enough to free a cut-off node.
SILENCE = 90.0
# Worker lines are sent to the launcher in batches: at most this many seconds late, this many
# lines or bytes to a batch.
LINE_BATCH_EVERY = 0.05
LINE_BATCH_MAX = 1000
LINE_BATCH_BYTES = 256 * 1024
# Bytes of events that may wait for a link nobody reads (a partition closes nothing: the
# socket's buffers fill and a write blocks for good); beyond that, events are dropped.
OUT_MAX = 16 * 1024 * 1024
# Worker lines wait for room (only the thread that reads them from torchrun waits; torchrun's
# own tee then waits, never the workers, which write to files) while more than this many bytes
# wait for a link that is still taking them: a burst larger than OUT_MAX (one 17 MiB line) over
# a slow link arrives whole instead of in part.
LINES_WAIT_ABOVE = OUT_MAX // 2
# Seconds with bytes waiting and none written after which the link counts as stalled (cut):
# lines stop waiting for it and, past OUT_MAX, are dropped and counted.
LINK_STALLED = 10.0
# Seconds an exiting agent waits for its last events to reach the launcher.
DRAIN_AT_EXIT = 10.0
# Seconds an agent that stopped its attempt for a silent launcher waits for it to come back
# (its report is then delivered and the job restarted) before it exits.
LINGER = 300.0

_LEAVE = object()


def alive_every(request: dict[str, Any]) -> float:
    """Seconds between "alive" events: ALIVE_EVERY, or the request's ``report_every`` (how
    often the node reports its ranks' progress) when longer, so that on a training node the
    reports alone say it is alive."""
    return max(ALIVE_EVERY, float(request.get("report_every") or 0))


class StdoutEmitter:
    """Writes events to stdout; a broken pipe means the launcher is gone.

    Worker lines travel in batches (``{"e": "lines", "b": [[rank, local rank, stream, text],
    ...]}``), at most LINE_BATCH_EVERY seconds late: one event for many lines keeps the
    launcher's work per line small on large jobs. Any other event first sends the lines
    queued before it, so the order of everything holds.

    Nothing that emits ever waits on the link: a writer thread of its own writes what is
    queued. A cut link (a partition closes nothing, its buffers fill) blocks that thread only,
    never the attempt that must stop its workers for the silent launcher; past OUT_MAX bytes
    waiting, events are dropped (nobody reads them), and the first one after the link drains
    says how many were. A link that is slow but taking bytes loses nothing: worker lines wait
    for it (``_wait_for_room``).
    """

    def __init__(
        self,
        on_broken: Callable[[], None],
        alive_every: float = ALIVE_EVERY,
        clock: Callable[[], float] = time.monotonic,
        stream: Any = None,
    ) -> None:
        self._lock = threading.Condition()
        self._alive_every = alive_every
        self._clock = clock
        self._on_broken = on_broken
        self._broken = False
        self._lines: list[list[Any]] = []
        self._bytes = 0
        self._last_write = float("-inf")
        self._out: collections.deque[bytes] = collections.deque()
        self._out_bytes = 0
        self._dropped = 0
        self._last_progress = time.monotonic()
        self._out_ready = threading.Condition()
        self._stream = stream if stream is not None else sys.stdout.buffer
        threading.Thread(target=self._flush_lines, daemon=True).start()
        threading.Thread(target=self._write_out, daemon=True).start()

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event.get("e")
        if kind == "line":
            self._wait_for_room()  # outside the lock: other events never wait for the link
        with self._lock:
            if kind == "alive" and self._said_lately():
                return  # any event says the node is alive: on a busy node "alive" is noise
            if kind == "line":
                text = event.get("t", "")
                self._lines.append([event.get("r"), event.get("l"), event.get("s"), text])
                self._bytes += len(text)
                if len(self._lines) >= LINE_BATCH_MAX or self._bytes >= LINE_BATCH_BYTES:
                    self._send_lines()
                else:
                    self._lock.notify()
                return
            self._send_lines()
            self._write(encode(event))

    def _wait_for_room(self) -> None:
        """Hold a worker line while a backlog drains over a link that is still taking bytes."""
        if self._out_bytes <= LINES_WAIT_ABOVE:
            return  # read unlocked (an int): a line takes no extra lock unless a backlog waits
        with self._out_ready:
            while (
                self._out_bytes > LINES_WAIT_ABOVE
                and not self._broken
                and time.monotonic() - self._last_progress < LINK_STALLED
            ):
                self._out_ready.wait(0.5)

    def _flush_lines(self) -> None:
        while True:
            with self._lock:
                while not self._lines:
                    self._lock.wait()
            time.sleep(LINE_BATCH_EVERY)  # let a burst gather
            with self._lock:
                self._send_lines()

    def _said_lately(self) -> bool:
        """Whether something went out, or waits to, within the last alive_every seconds."""
        return bool(self._lines) or self._clock() - self._last_write < self._alive_every

    def _send_lines(self) -> None:
        if self._lines:
            batch, self._lines, self._bytes = self._lines, [], 0
            self._write(encode({"e": "lines", "b": batch}))

    def _write(self, data: bytes) -> None:
        """Queue ``data`` for the writer thread; never blocks."""
        if self._broken:
            return
        self._last_write = self._clock()
        with self._out_ready:
            if self._out_bytes + len(data) > OUT_MAX:
                self._dropped += 1
                return
            if not self._out:
                self._last_progress = time.monotonic()  # an idle link is not a stalled one
            self._out.append(data)
            self._out_bytes += len(data)
            self._out_ready.notify_all()  # the writer, among lines waiting for room

    def _write_out(self) -> None:
        """The only writer to the link: blocks for as long as the link does, alone."""
        while True:
            with self._out_ready:
                while not self._out:
                    self._out_ready.wait()
                data = self._out.popleft()
                queued = len(data)
                dropped, self._dropped = self._dropped, 0
            if dropped:
                data = encode({"e": "dropped", "n": dropped}) + data
            try:
                self._stream.write(data)
                self._stream.flush()
            except (BrokenPipeError, OSError, ValueError):
                self._broken = True
                self._on_broken()
                return
            finally:
                with self._out_ready:
                    self._out_bytes -= queued
                    self._last_progress = time.monotonic()  # (a broken link waits for nobody)
                    self._out_ready.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for everything queued to be written (an agent's last
        events before it exits); False when the link did not take it in time."""
        self._send_lines_now()
        deadline = time.monotonic() + timeout
        while not self._broken and self.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.pending()

    def _send_lines_now(self) -> None:
        with self._lock:
            self._send_lines()

    def pending(self) -> int:
        """Bytes queued for the link and not yet written."""
        with self._out_ready:
            return self._out_bytes


class Agent:
    """The node's agent over one link to the launcher: attempts, one at a time."""

    def __init__(
        self, first: dict[str, Any], emit: Callable[[dict[str, Any]], None], lines: Lines
    ) -> None:
        self.emit = emit
        self.lines = lines
        self.request = first
        self.current: NodeAttempt | None = None
        self.prewarmed: Prewarmed | None = None
        self.requests: queue.Queue[object] = queue.Queue()
        self.leaving = threading.Event()
        self.leave_why = ""
        self.last_heard = time.monotonic()
        self.pending: list[dict[str, Any]] = []
        """Commands for an attempt that has not started here yet (ATTEMPT_COMMANDS)."""
        self._lock = threading.Lock()
        heartbeat = float(first.get("heartbeat") or 0)
        self.silence = float(first.get("silence") or SILENCE) if heartbeat else 0.0

    # -- the attempts -------------------------------------------------------------------------

    def serve(self) -> int:
        """Run attempts as the launcher asks until it leaves; the last attempt's exit code."""
        request: dict[str, Any] | None = self.request
        code = 0
        while request is not None:
            with self._lock:
                prewarmed, self.prewarmed = self.prewarmed, None
                self.current = NodeAttempt(request, self.emit, prewarmed)
                self.request = request
                if self.leaving.is_set():
                    self.current.request_stop(self.leave_why)
                number = _attempt_number(self.current.attempt)
                waiting = [c for c in self.pending if _attempt_number(c["attempt"]) == number]
                self.pending = [c for c in self.pending if _attempt_number(c["attempt"]) > number]
            for command in waiting:
                self.handle(command)
            code = self.current.run()
            # Only a launcher that keeps its agents (and says so) sends another attempt.
            request = self._next_request() if request.get("serve") else None
        self._discard_prewarmed()
        return code

    def _next_request(self) -> dict[str, Any] | None:
        """The next attempt's request, or None once the launcher leaves (or never returns)."""
        while True:
            if self.leaving.is_set():
                return None
            try:
                item = self.requests.get(timeout=1.0)
            except queue.Empty:
                if self.silence and time.monotonic() - self.last_heard > self.silence + LINGER:
                    return None  # stopped for a silent launcher, which never came back
                continue
            if item is _LEAVE:
                return None
            if isinstance(item, dict):
                return item

    def leave(self, why: str) -> None:
        """End the current attempt and exit once it has ended."""
        with self._lock:
            if not self.leaving.is_set():
                self.leave_why = why
                self.leaving.set()
            if self.current is not None:
                self.current.request_stop(why)
        self.requests.put(_LEAVE)

    def prewarm(self, attempt: int | str) -> None:
        """Warm torchrun's wrapper for ``attempt`` (the last request's command and place)."""
        last = self.request
        spec = {
            "python": (last.get("argv") or ["python3"])[0],
            "workdir": last.get("workdir"),
            "job_id": last["job_id"],
            "node": last["node"],
            "attempt": attempt,
        }
        with self._lock:
            if self.prewarmed is not None and self.prewarmed.attempt == str(attempt):
                return
            old, self.prewarmed = self.prewarmed, None
        if old is not None:
            old.discard()
        try:
            warmed = Prewarmed(spec)
        except OSError:
            return  # the attempt starts a wrapper of its own
        with self._lock:
            self.prewarmed = warmed

    def _discard_prewarmed(self) -> None:
        with self._lock:
            old, self.prewarmed = self.prewarmed, None
        if old is not None:
            old.discard()

    # -- the link -----------------------------------------------------------------------------

    def read_commands(self) -> None:
        """The launcher's commands, until stdin closes (then the job ends here)."""
        while (line := self.lines.get()) is not None:
            self.last_heard = time.monotonic()
            try:
                command = json.loads(line)
            except ValueError:
                continue
            if isinstance(command, dict):
                self.handle(command)
        self.leave("launcher-gone")

    def handle(self, command: dict[str, Any]) -> None:
        kind = command.get("cmd")
        current = self.current
        if kind in ATTEMPT_COMMANDS and command.get("attempt") is not None:
            # Meant for one attempt: an earlier attempt's is ignored; a later one's waits
            # until that attempt starts here (its request may still be on its way).
            with self._lock:
                current = self.current
                meant = _attempt_number(command["attempt"])
                here = _attempt_number(current.attempt) if current is not None else None
                if here is None or meant > here:
                    self.pending.append(command)
                    return
                if meant < here:
                    return
        if kind == "run" and isinstance(command.get("request"), dict):
            self.requests.put(command["request"])
        elif kind == "stop":
            if command.get("next") is not None:
                # Warm the next attempt's wrapper while this one stops (a restart in place).
                threading.Thread(target=self.prewarm, args=(command["next"],), daemon=True).start()
            if current is not None:
                current.request_stop("asked", stacks_first=bool(command.get("stacks")))
        elif kind == "kill":
            if current is not None:
                threading.Thread(target=current.kill_now, daemon=True).start()
        elif kind == "prewarm" and command.get("attempt") is not None:
            threading.Thread(target=self.prewarm, args=(command["attempt"],), daemon=True).start()
        elif kind == "bye":
            self.leave("asked")
        elif kind == "save" and current is not None:
            current.request_save()
        elif kind == "stacks" and current is not None:
            threading.Thread(
                target=current.send_stacks, args=("asked by the launcher",), daemon=True
            ).start()
        elif kind == "look" and current is not None:
            threading.Thread(
                target=self._look, args=(current, command.get("id")), daemon=True
            ).start()
        elif kind == "why-slow" and current is not None and command.get("rank") is not None:
            threading.Thread(
                target=self._why_slow, args=(current, int(command["rank"])), daemon=True
            ).start()
        elif kind == "port":
            from .probe import check_port

            self.emit({"e": "port", "port": check_port(0).get("port", 0)})

    def _look(self, attempt: NodeAttempt, look_id: object) -> None:
        process = attempt.process
        running = process.pid if process is not None and process.poll() is None else None
        # The attempt's processes are all below this agent (a subreaper): its pid bounds the
        # search for its ranks to them, not every process on the node.
        event = look_event(
            attempt.job_id,
            attempt.node,
            attempt.attempt,
            attempt.progress_dir,
            running,
            under=os.getpid(),
        )
        if look_id is not None:
            event["id"] = look_id
        self.emit(event)

    def _why_slow(self, attempt: NodeAttempt, rank: int) -> None:
        from .slow import why_slow_event

        self.emit(why_slow_event(attempt.job_id, attempt.node, attempt.attempt, rank, os.getpid()))

    def say_alive(self) -> None:
        while not self.leaving.wait(alive_every(self.request)):
            self.emit({"e": "alive"})

    def watch_launcher(self) -> None:
        """A partition closes nothing (sshd may keep stdin open for hours), and a stopped or
        suspended launcher says nothing: after ``silence`` s without a word, end the attempt;
        keep waiting for the launcher (LINGER) so that it can learn why and restart."""
        while not self.leaving.wait(1.0):
            silent = time.monotonic() - self.last_heard
            current = self.current
            if (
                silent > self.silence
                and current is not None
                and not current.stop_requested.is_set()
            ):
                # The stop first: stderr goes to the same dead link, and a write to it may
                # block once the pipe is full; the line is only for the node's own log.
                current.request_stop("launcher-silent")
                # Nor is the next attempt's warm wrapper (torch imported: hundreds of MB)
                # kept for a launcher that may never come back; one that does restarts
                # with a wrapper started then.
                self._discard_prewarmed()
                with contextlib.suppress(OSError, ValueError):
                    print(
                        f"torchherd agent: no word from the launcher for {silent:.0f} s; "
                        "stopping the job here",
                        file=sys.stderr,
                        flush=True,
                    )


class Lines:
    """stdin's lines, read by a thread of its own, so that a wait for the next one can time
    out (a partition closes nothing); None once stdin has closed."""

    def __init__(self, stream: Any = None) -> None:
        self._stream = stream or sys.stdin.buffer
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._stream:
            self._queue.put(line)
        self._queue.put(None)

    def get(self, timeout: float | None = None) -> bytes | None:
        """The next line; None when stdin closed; TimeoutError after ``timeout`` s."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None


def first_request(lines: Lines) -> tuple[dict[str, Any], Prewarmed | None] | None:
    """The first job request, and the wrapper warmed while it was awaited; None when the
    launcher leaves first (or says nothing for SILENCE s). ValueError: not JSON.

    Before its first request an agent may only warm: a session opened while the launcher
    probes (``{"prewarm": spec}``), or a hot spare's, kept warm for the attempt it may join
    (``{"cmd": "prewarm", "attempt": N}``) and pinged meanwhile."""
    prewarmed: Prewarmed | None = None
    spec: dict[str, Any] | None = None
    while True:
        try:
            line = lines.get(timeout=SILENCE)
        except TimeoutError:
            line = None
        message = json.loads(line) if line is not None and line.strip() else None
        if not isinstance(message, dict) or message.get("cmd") in ("stop", "bye"):
            if prewarmed is not None:
                prewarmed.discard()
            return None
        if "job_id" in message:
            return message, prewarmed
        if "probe" in message:
            answer_probe(message["probe"])
            continue
        if "prewarm" in message:
            spec = dict(message["prewarm"])
        elif message.get("cmd") == "prewarm" and spec is not None:
            spec["attempt"] = message.get("attempt", spec.get("attempt", 0))
        else:
            if message.get("cmd") == "ping":
                # An idle agent (a spare, a node back) answers, so the launcher can tell it
                # from one cut off: a spare that does not answer is never chosen.
                sys.stdout.buffer.write(encode({"e": "alive"}))
                sys.stdout.buffer.flush()
            continue
        if prewarmed is not None:
            prewarmed.discard()
        prewarmed = Prewarmed(spec)


# When this agent was ready to read the launcher (the node's clock): the probe's answer says
# how long before the answer that was, which splits the launcher's "agent start" from "probe".
READY_AT: float | None = None


def answer_probe(request: Any) -> None:
    """The quick probe over the link, so that a launch costs a node one session, not two.
    A probe that fails answers no facts: the launcher then probes in a session of its own,
    whose error says why."""
    from .probe import collect

    try:
        event: dict[str, Any] = {"e": "probe", "facts": collect(dict(request))}
    except Exception as exc:  # noqa: BLE001 - any failure: the launcher's own probe explains
        event = {"e": "probe", "error": f"{type(exc).__name__}: {exc}"}
    now = time.time()
    event["agent_for"] = round(now - (READY_AT or now), 4)
    sys.stdout.buffer.write(encode(event))
    sys.stdout.buffer.flush()


def main() -> int:
    global READY_AT
    READY_AT = time.time()
    lines = Lines()
    try:
        found = first_request(lines)
    except ValueError:
        print("torchherd agent: expected a JSON job request on stdin", file=sys.stderr)
        return 2
    if found is None:
        return 0  # the launch did not happen here (or this spare was not needed)
    request, prewarmed = found
    if request.get("detach"):
        # Before any thread starts: the daemon is made with fork().
        from .detach import run_detached

        return run_detached(request)
    agent: Agent | None = None

    def gone() -> None:
        if agent is not None:
            agent.leave("launcher-gone")

    emitter = StdoutEmitter(on_broken=gone, alive_every=alive_every(request))
    agent = Agent(request, emitter, lines)
    agent.prewarmed = prewarmed

    def on_signal(*_: object) -> None:
        assert agent is not None
        agent.leave("signal")

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # SIGPIPE stays ignored (Python's default), so a dead launcher shows up as BrokenPipeError.
    threading.Thread(target=agent.read_commands, daemon=True).start()
    threading.Thread(target=agent.say_alive, daemon=True).start()
    if agent.silence:
        threading.Thread(target=agent.watch_launcher, daemon=True).start()
    code = agent.serve()
    emitter.drain(DRAIN_AT_EXIT)
    return code
