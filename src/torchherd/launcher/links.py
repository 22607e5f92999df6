"""Links to node agents: one session per node (ssh, srun or a local process), kept for the job.

A link carries JSON lines both ways (agent.protocol): the launcher's commands on the agent's
stdin, the agent's events on its stdout. It outlives attempts: a restart with every node still
answering runs the next attempt through the same links, so it costs no new session, no new
agent and no cold torch import. Each attempt hands the link its own event handler.

A link ends when its process does (the agent exited, ssh lost its connection, or herd cut it):
``ended`` is then set, and the link is never used again.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import json
import sys
import termios
import time
from collections.abc import Callable
from typing import Any

from ..agent.protocol import decode
from ..spec import ClusterSpec, NodeSpec
from ..transport import Transport

EventHandler = Callable[[dict[str, Any]], None]
TextHandler = Callable[[str], None]


class AgentLink:
    """One node's agent session."""

    def __init__(self, node: NodeSpec, process: asyncio.subprocess.Process, *, fresh: bool):
        self.node = node
        self.host = node.host
        self.process = process
        self.fresh = fresh
        """Nothing beyond a prewarm line was sent: the next job request goes as it is."""
        self.on_event: EventHandler | None = None
        self.on_text: TextHandler | None = None
        """Lines that are not events (a shell's motd, the agent's own error output)."""
        self.stderr: collections.deque[str] = collections.deque(maxlen=30)
        self.exit_code: int | None = None
        self.ended = asyncio.Event()
        self.cut_off = False
        """True once herd killed the session itself (``cut``)."""
        self.heard_at = time.monotonic()
        """When the agent last said anything (an idle agent answers pings with "alive")."""
        self.agent_for: float | None = None
        """Seconds the agent had been ready when it answered the probe (startup.py splits
        the launcher's "agent start" from "probe" with it)."""
        self.answers_pings = False
        """The agent answered a ping while idle (an older agent says nothing until it runs)."""
        self._readers: list[asyncio.Task[None]] = []

    @classmethod
    async def open(
        cls,
        transport: Transport,
        cluster: ClusterSpec,
        node: NodeSpec,
        prewarm: dict[str, Any] | None = None,
    ) -> AgentLink:
        """Start the node's agent; with ``prewarm`` (a spec), it warms torchrun's wrapper at
        once, while the launcher is still busy. OSError when the session cannot start."""
        python = cluster.python_for(node)
        process = await transport.start(node, [python, "-m", "torchherd.agent", "run"])
        link = cls(node, process, fresh=True)
        if prewarm is not None:
            link.write({"prewarm": prewarm | {"node": node.name}})
        return link

    async def probe(self, request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """The quick probe's facts, asked over this link before anything reads it (the agent
        answers before its first job request): a session saved per node. None when the
        agent cannot answer (it ended, could not probe, is of an older version that ignores
        the question, or took more than ``timeout`` s); the caller then probes the usual way."""
        if self._readers or not self.write({"probe": request}):
            return None
        try:
            return await asyncio.wait_for(self._probe_answer(), timeout)
        except TimeoutError:
            return None

    async def _probe_answer(self) -> dict[str, Any] | None:
        assert self.process.stdout is not None
        async for raw in lines(self.process.stdout):
            event = decode(raw)
            if event is not None and event.get("e") == "probe":
                if isinstance(event.get("agent_for"), int | float):
                    self.agent_for = float(event["agent_for"])
                facts = event.get("facts")
                return facts if isinstance(facts, dict) else None
        return None  # the agent ended first

    def start_reading(self) -> None:
        if not self._readers:
            stderr = asyncio.create_task(self._read_stderr())
            self._readers = [asyncio.create_task(self._read_events(stderr)), stderr]

    @property
    def alive(self) -> bool:
        return not self.ended.is_set() and self.process.returncode is None

    def silent_for(self) -> float:
        """Seconds since the agent last said anything."""
        return time.monotonic() - self.heard_at

    def write(self, message: dict[str, Any]) -> bool:
        """Send one JSON line; False when the link cannot take it (closed or broken)."""
        stdin = self.process.stdin
        if stdin is None or stdin.is_closing() or not self.alive:
            return False
        try:
            stdin.write(json.dumps(message).encode() + b"\n")
        except (ConnectionError, OSError, RuntimeError):
            return False
        return True

    def command(self, cmd: str, **fields: Any) -> bool:
        return self.write({"cmd": cmd, **fields})

    def run(self, request: dict[str, Any]) -> bool:
        """Ask the agent to run an attempt."""
        if self.fresh:
            self.fresh = False
            return self.write(request)
        return self.command("run", request=request)

    def close(self) -> None:
        """Tell the agent to end what runs and exit (its stdin closes)."""
        stdin = self.process.stdin
        if stdin is not None and not stdin.is_closing():
            try:
                stdin.close()
            except (ConnectionError, OSError, RuntimeError):
                pass

    def cut(self) -> None:
        """Kill the session itself: its agent sees its stdin close (if it still can)."""
        self.cut_off = True
        if self.process.returncode is None:
            try:
                self.process.kill()
            except ProcessLookupError:
                pass

    def has_unread(self) -> bool:
        """Whether the agent said something this launcher has not read yet (bytes waiting in
        the pipe, or read but not yet handled): a node with unread words is not silent, the
        launcher is behind."""
        reader = self.process.stdout
        if reader is not None and len(getattr(reader, "_buffer", b"")):
            return True
        transport = getattr(self.process, "_transport", None)
        pipe = transport.get_pipe_transport(1) if transport is not None else None
        handle = pipe.get_extra_info("pipe") if pipe is not None else None
        if handle is None:
            return False
        try:
            waiting = fcntl.ioctl(handle.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except (OSError, ValueError):
            return False
        return int.from_bytes(waiting, sys.byteorder) > 0

    async def wait_ended(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.ended.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def finish(self, timeout: float = 5.0) -> None:
        """Close the link and wait for its session to end (killing it after ``timeout``)."""
        self.close()
        if not await self.wait_ended(timeout):
            self.cut()
            await self.wait_ended(5.0)
        for task in self._readers:
            task.cancel()

    async def _read_events(self, stderr: asyncio.Task[None]) -> None:
        assert self.process.stdout is not None
        try:
            async for raw in lines(self.process.stdout):
                self.heard_at = time.monotonic()
                event = decode(raw)
                if event is not None and event.get("e") == "alive" and self.on_event is None:
                    self.answers_pings = True
                if event is None:
                    if self.on_text is not None:
                        self.on_text(raw.decode(errors="replace").rstrip())
                    continue
                if self.on_event is not None:
                    self.on_event(event)
        finally:
            # Its last words on stderr (why ssh failed, a traceback) come with its end.
            await asyncio.wait([stderr], timeout=2.0)
            self.exit_code = await self.process.wait()
            self.ended.set()

    async def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        async for raw in lines(self.process.stderr):
            text = raw.decode(errors="replace").rstrip()
            self.stderr.append(text)
            if self.on_text is not None:
                self.on_text(text)


async def lines(stream: asyncio.StreamReader) -> Any:
    """Lines of a stream; a line longer than the reader's limit comes in pieces, never as an
    error that would end the supervision (agents split long lines, other output may not)."""
    while True:
        try:
            raw = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                yield exc.partial
            return
        except asyncio.LimitOverrunError as exc:
            raw = await stream.readexactly(exc.consumed)
        yield raw
