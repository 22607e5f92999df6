"""`python -m torchherd.agent.relay`: one node's end of a relay link (standard library only).

Where one scheduler step starts a task on every node (Slurm: one ``srun`` across the
allocation instead of one per node), each task runs this relay. It reads the launcher's token
as the first line of stdin (the step broadcasts it; it never appears on a command line),
connects back to the launcher (the address the scheduler gives: SLURM_LAUNCH_NODE_IPADDR, where
srun itself runs), says which node it is, receives the command to run there, runs it, and
relays its stdin, stdout, stderr and exit code over that one connection, as an ssh session
would. When the connection drops (the launcher is gone, or cut the node off) the command's
stdin closes, which a node agent takes as "stop the job"; the relay ends with the command.

Over ssh (a tree of nodes: transport/tree.py) the relay is started by another node's fan-out
(agent/fanout.py), over an ssh session that must not hold the command: with HERD_RELAY_DETACH
set, once the launcher has given it the command the relay leaves that session (a new session of
its own, its stdio on /dev/null), so the ssh session ends at once, and whatever becomes of the
node that started it (lost, cut off), the command's link to the launcher stays. The launcher's
address is then HERD_RELAY_HOST, or, written ``@ssh-client``, the address this node's own ssh
session came from.

Frames, both ways: one byte for the kind, four for the length (big-endian), then the payload:
    node -> launcher:  H hello (JSON)   o stdout   e stderr   x exit (JSON {"code": int})
    launcher -> node:  C command (JSON {"argv": [...]})   I stdin   E end of stdin
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import IO, Any

HEADER = struct.Struct(">cI")
HELLO, COMMAND, STDIN, STDIN_END, STDOUT, STDERR, EXIT = (
    b"H",
    b"C",
    b"I",
    b"E",
    b"o",
    b"e",
    b"x",
)
MAX_FRAME = 1 << 24
# Variables that tell the relay where the launcher is; its command does not inherit them.
PORT_VAR = "HERD_RELAY_PORT"
HOST_VAR = "HERD_RELAY_HOST"
BATCH_VAR = "HERD_RELAY_BATCH"
NODE_VAR = "HERD_RELAY_NODE"
DETACH_VAR = "HERD_RELAY_DETACH"
RELAY_VARS = (PORT_VAR, HOST_VAR, BATCH_VAR, NODE_VAR, DETACH_VAR)
LAUNCH_ADDR_VARS = ("SLURM_LAUNCH_NODE_IPADDR", HOST_VAR)
# HERD_RELAY_HOST's value for "where this node's ssh session came from" (SSH_CONNECTION).
SSH_CLIENT_ADDR = "@ssh-client"
# The words a relay says when it cannot reach the launcher (the launcher classifies them).
CANNOT_CONNECT = "herd relay: cannot connect to the launcher"
CONNECT_TIMEOUT = 30.0


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


class FrameReader:
    """Splits a byte stream into (kind, payload) frames; feed it what arrives."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= HEADER.size:
            kind, length = HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME:
                raise ValueError(f"frame of {length} bytes")
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append((kind, bytes(self._buffer[HEADER.size : end])))
            del self._buffer[:end]
        return frames


class Link:
    """The connection to the launcher: frames out (from several threads), frames in."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.reader = FrameReader()
        self.pending: list[tuple[bytes, bytes]] = []
        self.broken = False

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        with self.lock:
            if self.broken:
                return
            try:
                self.sock.sendall(frame(kind, payload))
            except OSError:
                self.broken = True

    def receive(self) -> tuple[bytes, bytes] | None:
        """The next frame; None once the launcher closed the connection (or it broke)."""
        while not self.pending:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                return None
            self.pending += self.reader.feed(data)
        return self.pending.pop(0)


def connect(environ: dict[str, str]) -> socket.socket:
    port = int(environ[PORT_VAR])
    errors = []
    for var in LAUNCH_ADDR_VARS:
        host = environ.get(var)
        if host == SSH_CLIENT_ADDR:
            host = (environ.get("SSH_CONNECTION") or "").split(" ", 1)[0]
        if not host:
            continue
        try:
            return socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            errors.append(f"{host}:{port} ({var}): {exc}")
    raise OSError("; ".join(errors) or f"no launcher address ({', '.join(LAUNCH_ADDR_VARS)})")


def pump(stream: IO[bytes], kind: bytes, link: Link) -> None:
    """Copy a pipe of the command to the launcher, as it comes."""
    while True:
        data = os.read(stream.fileno(), 1 << 16)
        if not data:
            return
        link.send(kind, data)


def feed_stdin(link: Link, stdin: IO[bytes]) -> None:
    """The launcher's frames to the command's stdin; its end, or the link's, closes it."""
    while True:
        received = link.receive()
        if received is None or received[0] == STDIN_END:
            break
        if received[0] == STDIN:
            try:
                stdin.write(received[1])
                stdin.flush()
            except OSError:
                pass  # the command no longer reads; its exit comes
    try:
        stdin.close()
    except OSError:
        pass


def run(argv: list[str], link: Link, environ: dict[str, str]) -> int:
    env = {k: v for k, v in environ.items() if k not in RELAY_VARS}
    argv = [os.path.expanduser(argv[0]), *argv[1:]]
    try:
        process = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    except OSError as exc:
        link.send(STDERR, f"cannot run {argv[0]}: {exc}\n".encode())
        return 127
    assert process.stdin and process.stdout and process.stderr
    threading.Thread(target=feed_stdin, args=(link, process.stdin), daemon=True).start()
    pumps = [
        threading.Thread(target=pump, args=(process.stdout, STDOUT, link), daemon=True),
        threading.Thread(target=pump, args=(process.stderr, STDERR, link), daemon=True),
    ]
    for thread in pumps:
        thread.start()
    code = process.wait()
    for thread in pumps:
        thread.join()
    return code


def _stay(*_: object) -> None:
    pass


def detach() -> None:
    """Leave the session that started this relay: the parent exits (so the ssh session that
    ran it ends), the child goes on in a session of its own with its stdio on /dev/null."""
    if os.fork():
        os._exit(0)
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if null > 2:
        os.close(null)


def main(environ: dict[str, str] | None = None) -> int:
    environ = dict(os.environ if environ is None else environ)
    # The step's end (scancel, a time limit) signals every process of the step: the command
    # ends its own way and says so through this relay, which stays until it has. (A handler,
    # not SIG_IGN: the command must not inherit an ignored SIGTERM.)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stay)
    token = sys.stdin.readline().strip()
    try:
        sock = connect(environ)
    except (OSError, KeyError, ValueError) as exc:
        print(f"{CANNOT_CONNECT}: {exc}", file=sys.stderr, flush=True)
        return 1
    sock.settimeout(None)
    link = Link(sock)
    hello: dict[str, Any] = {
        "token": token,
        "batch": environ.get(BATCH_VAR, ""),
        "node": environ.get(NODE_VAR) or environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "task": environ.get("SLURM_PROCID"),
    }
    link.send(HELLO, json.dumps(hello).encode())
    received = link.receive()
    if received is None or received[0] != COMMAND:
        return 0  # not wanted (a wrong token, or the launcher gave up on this node)
    if environ.get(DETACH_VAR):
        detach()
    code = run(list(json.loads(received[1])["argv"]), link, environ)
    link.send(EXIT, json.dumps({"code": code}).encode())
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
