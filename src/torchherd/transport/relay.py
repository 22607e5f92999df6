"""Relay links: commands on many nodes started by one scheduler step, each with a link of its own.

A scheduler starts a step's tasks on every node at once (one ``srun`` across the allocation),
but gives the launcher one stdin and one merged output for all of them. A node agent needs a
channel of its own (its job request, pings, stop; its events), so each task runs the relay
(torchherd.agent.relay), which connects back to the launcher and carries one command's stdin,
stdout, stderr and exit code over that connection. Here is the launcher's end:

  RelayServer      listens (every address, a port chosen by the kernel) for relays, which
                   prove themselves with a random token sent to them over the step's stdin
  RelayedProcess   one command on one node, as asyncio.subprocess.Process offers it (stdin,
                   stdout, stderr, wait, communicate, kill), so the rest of herd drives it as
                   it drives an ssh session; kill() cuts the link as killing an ssh client does
  StepBatch        the commands of one step: the same command on several nodes, gathered from
                   the per-node ``start`` calls made together (Transport.each) before the step
                   is started; a task that never connected is finished from the step's own
                   words (its labelled output and srun's exit line for it)

The link is TCP between the nodes and the launcher, as srun's own I/O forwarding is (the relay
dials the address srun launched from), and carries what an ssh session would (the job request
with the env_file secrets included) without encryption, as srun's own I/O does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import re
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..agent.relay import (
    CANNOT_CONNECT,
    COMMAND,
    EXIT,
    HELLO,
    STDERR,
    STDIN,
    STDIN_END,
    STDOUT,
    FrameReader,
    frame,
)
from .base import Unreachable

LIMIT = 1 << 24
# Seconds a relay gets to say who it is once connected.
HELLO_TIMEOUT = 30.0
# Exit code of a command whose link was lost or cut, as ssh reports a lost connection.
LINK_LOST = 255
LINK_LOST_MARK = "herd: lost the relay link to"
# How long start() calls may keep gathering into one step: a quiet moment, or at most this.
GATHER_QUIET = 0.02
GATHER_MAX = 0.25
# Seconds a closing relay server waits for its links to be closed by their ends.
CLOSE_WAIT_S = 2.0


class _StdinProtocol(asyncio.BaseProtocol):
    """What asyncio.StreamWriter needs from a protocol; writes never wait (frames are small)."""

    async def _drain_helper(self) -> None:
        return None

    def _get_close_waiter(self, stream: asyncio.StreamWriter) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


class _StdinTransport(asyncio.WriteTransport):
    """The command's stdin: frames on the link (held until the relay has connected)."""

    def __init__(self, process: RelayedProcess) -> None:
        super().__init__()
        self._process = process
        self._closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._closed and data:
            self._process.send(STDIN, bytes(data))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._process.send(STDIN_END)

    def write_eof(self) -> None:
        self.close()

    def can_write_eof(self) -> bool:
        return True

    def abort(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        return self._closed or self._process.returncode is not None

    def get_write_buffer_size(self) -> int:
        return 0


class RelayedProcess(asyncio.subprocess.Process):
    """A command on a node, reached over a relay link, offered as a subprocess is.

    There is no local process behind it (``pid`` is the step's srun, which carries the links
    of every node of the step), so nothing of asyncio's process machinery is used.
    """

    def __init__(self, host: str, loop: asyncio.AbstractEventLoop) -> None:
        # No super().__init__(): it wants a local process's transport.
        self.host = host
        self.pid = 0
        self._loop = loop
        self._out = asyncio.StreamReader(limit=LIMIT, loop=loop)
        self._err = asyncio.StreamReader(limit=LIMIT, loop=loop)
        self.stdout, self.stderr = self._out, self._err
        self._in = asyncio.StreamWriter(_StdinTransport(self), _StdinProtocol(), None, loop)
        self.stdin = self._in
        self._code: int | None = None
        self._exited: asyncio.Future[int] = loop.create_future()
        self._link: _LinkProtocol | None = None
        self._held: list[bytes] = []
        self.argv: list[str] = []

    # -- what asyncio.subprocess.Process offers ---------------------------------------------

    @property
    def returncode(self) -> int | None:  # type: ignore[override]
        return self._code

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    async def communicate(
        self, input: bytes | bytearray | memoryview | None = None
    ) -> tuple[bytes, bytes]:
        if input:
            self._in.write(input)
        self._in.close()
        out, err = await asyncio.gather(self._out.read(), self._err.read())
        await self.wait()
        return out, err

    def kill(self) -> None:
        """Cut the link: the relay closes the command's stdin (an agent then ends its job)."""
        if self._link is not None:
            self._link.close()
        self.finish(LINK_LOST)

    def terminate(self) -> None:
        self.kill()

    def send_signal(self, signal: int) -> None:
        self.kill()

    # -- the link ------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._code is not None

    @property
    def attached(self) -> bool:
        """Its relay has connected (from then on only its link says how it ends)."""
        return self._link is not None

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        data = frame(kind, payload)
        if self._link is None:
            self._held.append(data)
        elif not self.finished:
            self._link.write(data)

    def attach(self, link: _LinkProtocol) -> None:
        """The relay on the node has connected: give it the command and what stdin holds."""
        self._link = link
        if link.transport is not None:
            self._out.set_transport(link.transport)  # a reader far behind pauses the link
        link.write(frame(COMMAND, json.dumps({"argv": self.argv}).encode()))
        for data in self._held:
            link.write(data)
        self._held.clear()

    def on_frame(self, kind: bytes, payload: bytes) -> None:
        if kind == STDOUT:
            self._out.feed_data(payload)
        elif kind == STDERR:
            self._err.feed_data(payload)
        elif kind == EXIT:
            self.finish(int(json.loads(payload)["code"]))

    def on_link_lost(self) -> None:
        if not self.finished:
            self._err.feed_data(f"{LINK_LOST_MARK} {self.host}\n".encode())
            self.finish(LINK_LOST)

    def finish(self, code: int, stderr: bytes = b"") -> None:
        """The command ended (or its link did): its streams end, its waiters wake."""
        if self.finished:
            return
        self._code = code
        if stderr:
            self._err.feed_data(stderr)
        for reader in (self._out, self._err):
            if not reader.at_eof():
                reader.feed_eof()
        if not self._exited.done():
            self._exited.set_result(code)
        if self._link is not None:
            self._link.close()


class _LinkProtocol(asyncio.Protocol):
    """One relay's connection: its hello names the command it carries, then frames flow."""

    def __init__(self, server: RelayServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.frames = FrameReader()
        self.process: RelayedProcess | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT, self.close)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.frames.feed(data)
        except ValueError:
            self.close()
            return
        for kind, payload in frames:
            if self.process is not None:
                self.process.on_frame(kind, payload)
                continue
            if self._timer is not None:
                self._timer.cancel()
            process = self.server.claim(kind, payload)
            if process is None:
                self.close()  # a wrong token, or nothing expected from it
                return
            self.process = process
            process.attach(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.process is not None:
            self.process.on_link_lost()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class RelayServer:
    """Where the relays of every step connect back; started on first use."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._expected: dict[tuple[str, str], RelayedProcess] = {}

    async def start(self) -> None:
        if self._server is not None:
            return
        sock = _listening_socket()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _LinkProtocol(self), sock=sock)
        self.port = sock.getsockname()[1]

    def expect(self, batch: str, node: str, process: RelayedProcess) -> None:
        self._expected[(batch, node)] = process

    def forget(self, batch: str, node: str) -> None:
        self._expected.pop((batch, node), None)

    def claim(self, kind: bytes, payload: bytes) -> RelayedProcess | None:
        """The command a relay's hello asks for, once its token is right."""
        if kind != HELLO:
            return None
        try:
            hello = json.loads(payload)
            token, batch, node = str(hello["token"]), str(hello["batch"]), str(hello["node"])
        except (ValueError, KeyError, TypeError):
            return None
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            return None
        process = self._expected.pop((batch, node), None)
        if process is None:
            # The scheduler may name a node by its short name.
            process = self._expected.pop((batch, node.split(".", 1)[0]), None)
        if process is None or process.finished:
            return None
        return process

    async def close(self) -> None:
        """Stop listening. Links still open are their processes' to end: Python 3.12's
        wait_closed waits for every connection, so the wait is bounded."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), CLOSE_WAIT_S)
            self._server = None


def _listening_socket() -> socket.socket:
    """Every address, IPv4 and IPv6 where there is IPv6, one port."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", 0))
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("", 0))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


# ---------------------------------------------------------------------------------------------
# one step


# srun's line for a task that ended badly: "srun: error: node2: task 1: Exited with exit code 3"
# (also "tasks 0-2: ..." and "Killed"/"Terminated" for a signal); a tree's fan-out
# (agent/fanout.py) says the same of a node's ssh as "herd fanout: error: ...".
_TASK_END = re.compile(r"(?:srun|herd fanout): error: (\S+): tasks? ([\d,\-]+): (.*)$")
_EXIT_CODE = re.compile(r"Exited with exit code (\d+)")
_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")


@dataclass
class StepBatch:
    """The same command on several nodes, started as one step."""

    batch: str
    key: Any = None
    """What the commands of the step share (how the step starts them)."""
    processes: dict[str, RelayedProcess] = field(default_factory=dict)
    """node name -> its command."""
    hosts: dict[str, str] = field(default_factory=dict)
    """node name -> host, in the order they came."""
    srun: asyncio.subprocess.Process | None = None
    labelled: dict[int, list[str]] = field(default_factory=dict)
    """task id -> the lines it printed on the step's stderr (before its relay connected)."""
    own: list[str] = field(default_factory=list)
    """srun's own lines."""
    task_ends: dict[str, tuple[int, str]] = field(default_factory=dict)
    """node -> (task id, how srun says it ended)."""

    def add(self, name: str, host: str, process: RelayedProcess) -> None:
        self.processes[name] = process
        self.hosts[name] = host

    async def watch(self, server: RelayServer) -> None:
        """Read the step's output until srun ends; then finish every command still waiting
        for its relay with what the step said about it."""
        code = await self.read_step()
        for name, process in self.processes.items():
            server.forget(self.batch, name)
            if not process.finished:
                process.finish(*self.ended(name, code))

    async def read_step(self) -> int:
        """Read the step's output to its end; the step's exit code."""
        assert self.srun is not None and self.srun.stdout and self.srun.stderr
        await asyncio.gather(self._read(self.srun.stdout), self._read(self.srun.stderr))
        return await self.srun.wait()

    def ended(self, name: str, code: int) -> tuple[int, bytes]:
        """How the step says a node's task ended: its exit code and error output."""
        ended = self.task_ends.get(name)
        lines = list(self.labelled.get(ended[0], [])) if ended else []
        lines += [line for line in self.own if name in line or ": error:" not in line]
        found = _EXIT_CODE.search(ended[1]) if ended else None
        result = int(found.group(1)) if found else (code if code else 1)
        return result, "".join(f"{line}\n" for line in lines).encode()

    async def _read(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            line = raw.decode(errors="replace").rstrip("\r\n")
            ended = _TASK_END.search(line)
            if ended:
                for task in _task_ids(ended.group(2)):
                    self.task_ends[ended.group(1)] = (task, ended.group(3))
                self.own.append(line)
                continue
            labelled = _LABEL.match(line)
            if labelled and not line.startswith("srun:"):
                self.labelled.setdefault(int(labelled.group(1)), []).append(labelled.group(2))
            else:
                self.own.append(line)
            del self.own[:-50]

    @property
    def done(self) -> bool:
        return all(p.finished for p in self.processes.values())


def _task_ids(text: str) -> list[int]:
    ids: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            ids += list(range(int(low), int(high or low) + 1))
    return ids


Launch = Callable[[StepBatch, list[str]], Awaitable[asyncio.subprocess.Process]]
"""Starts a batch's step on its hosts (in order) and returns its srun."""


class StepGatherer:
    """Gathers per-node starts of the same command, made together, into one step each."""

    def __init__(
        self,
        server: RelayServer,
        launch: Launch,
        settle: Callable[[StepBatch], Awaitable[None]] | None = None,
    ) -> None:
        self.server = server
        self._launch = launch
        self._settle = settle
        """Watches a started step to its end instead of StepBatch.watch (the tree's)."""
        self._open: dict[Any, tuple[StepBatch, asyncio.Future[None]]] = {}
        self._timers: dict[Any, asyncio.TimerHandle] = {}
        self._first: dict[Any, float] = {}
        self._count = 0
        self.batches: list[StepBatch] = []
        self._watchers: list[asyncio.Task[None]] = []

    async def start(self, key: Any, name: str, host: str, argv: list[str]) -> RelayedProcess:
        loop = asyncio.get_running_loop()
        await self.server.start()
        entry = self._open.get(key)
        if entry is not None and name in entry[0].processes:
            self._flush(key)  # the same node twice: the second command goes in the next step
            entry = None
        if entry is None:
            self._count += 1
            entry = (StepBatch(f"{self._count}", key), loop.create_future())
            self._open[key] = entry
            self._first[key] = loop.time()
        batch, launched = entry
        process = RelayedProcess(host, loop)
        process.argv = argv
        batch.add(name, host, process)
        self.server.expect(batch.batch, name, process)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        delay = max(0.0, min(GATHER_QUIET, self._first[key] + GATHER_MAX - loop.time()))
        self._timers[key] = loop.call_later(delay, self._flush, key)
        await asyncio.shield(launched)
        return process

    def _flush(self, key: Any) -> None:
        entry = self._open.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if entry is None:
            return
        batch, launched = entry
        self._watchers.append(asyncio.get_running_loop().create_task(self._run(batch, launched)))

    async def _run(self, batch: StepBatch, launched: asyncio.Future[None]) -> None:
        try:
            batch.srun = await self._launch(batch, list(batch.hosts.values()))
        except Exception as exc:  # srun could not be started: every start() says why
            for name in batch.processes:
                self.server.forget(batch.batch, name)
            launched.set_exception(exc)
            return
        for process in batch.processes.values():
            process.pid = batch.srun.pid
        self.batches.append(batch)
        launched.set_result(None)
        if self._settle is not None:
            await self._settle(batch)
        else:
            await batch.watch(self.server)

    async def close(self, grace: float = 5.0) -> None:
        """End what is left: a step whose commands all ended is given ``grace`` seconds to
        end by itself, then its srun is terminated (it ends its tasks), then killed."""
        for batch in self.batches:
            srun = batch.srun
            if srun is None or srun.returncode is not None:
                continue
            for process in batch.processes.values():
                process.kill()
            for ask in (None, srun.terminate, srun.kill):
                if ask is not None:
                    try:
                        ask()
                    except ProcessLookupError:
                        break
                try:
                    await asyncio.wait_for(srun.wait(), grace)
                    break
                except TimeoutError:
                    continue
        for watcher in self._watchers:
            watcher.cancel()
        await self.server.close()


def relay_link_failure(
    host: str, returncode: int, stderr: str, *, cannot_connect: str, link_lost: str
) -> Unreachable | None:
    """An Unreachable when a node's relay link failed: it could not dial this launcher
    (``cannot_connect``: the fix), or its link dropped (``link_lost``: the fix); None when the
    failure, if any, is not the link's. Shared by every transport that runs relays."""
    if returncode != 0 and CANNOT_CONNECT in stderr:
        line = next(text for text in stderr.splitlines() if CANNOT_CONNECT in text)
        return Unreachable(host, "relay", line.strip(), cannot_connect)
    if returncode == LINK_LOST and LINK_LOST_MARK in stderr:
        return Unreachable(host, "link-lost", f"the link to {host} dropped", link_lost)
    return None
