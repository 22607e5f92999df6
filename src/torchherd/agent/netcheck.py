"""`python -m torchherd.agent net serve|check`: real TCP tests between nodes (stdlib only).

Rendezvous, NCCL and Gloo all need plain TCP between nodes: the store port on the rendezvous node
and ephemeral ports everywhere. A firewall that drops them shows up as a 10-minute hang at init,
so the doctor opens real listeners and makes real connections, with short timeouts, in parallel.

serve   First stdin line: {"ports": {"name": port, ...}, "max_seconds": s}; port 0 means an
        ephemeral port the kernel picks. Prints one line {"ports": {name: port}, "errors":
        {name: why}} once listening, then serves until stdin closes (or max_seconds pass).
        A connection's first byte says what it wants: b"P" echo (latency), b"S" sink (throughput:
        read to EOF, answer the byte count as 8 bytes); anything else is just accepted (connect).
check   First stdin line: {"targets": [{"name", "addr", "port", "pings", "bytes", "seconds"}],
        "timeout": s}. Connects to every target at once (latency from ``pings`` round trips),
        then measures throughput to each target that asked for it, one at a time so links do
        not share this node's NIC. Prints {"results": [...]} in target order.
"""

from __future__ import annotations

import errno
import json
import socket
import statistics
import struct
import sys
import threading
import time
from typing import IO, Any

CHUNK = 1 << 20
"""Bytes per send/recv in the throughput test."""
DEFAULT_MAX_SECONDS = 300.0
"""A listener left behind by a launcher that died still ends after this long."""


def main(argv: list[str]) -> int:
    verb = argv[0] if argv else ""
    line = sys.stdin.readline()
    request = json.loads(line) if line.strip() else {}
    if verb == "serve":
        return serve(request, sys.stdin, sys.stdout)
    if verb == "check":
        print(json.dumps({"results": check(request)}), flush=True)
        return 0
    print("usage: python -m torchherd.agent net serve|check", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------
# serve


def serve(request: dict[str, Any], stdin: IO[str], stdout: IO[str]) -> int:
    """Listen on the requested ports until stdin closes; see the module docstring."""
    listeners: list[socket.socket] = []
    ports: dict[str, int] = {}
    errors: dict[str, str] = {}
    for name, port in dict(request.get("ports") or {"ephemeral": 0}).items():
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # Like the TCPStore: a port in TIME_WAIT counts as free, one with a listener does not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", int(port)))
            sock.listen(256)
        except OSError as exc:
            sock.close()
            errors[name] = exc.strerror or str(exc)
            continue
        listeners.append(sock)
        ports[name] = sock.getsockname()[1]
    stdout.write(json.dumps({"ports": ports, "errors": errors}) + "\n")
    stdout.flush()
    for sock in listeners:
        threading.Thread(target=_accept_loop, args=(sock,), daemon=True).start()
    closed = threading.Event()

    def wait_for_eof() -> None:
        while stdin.readline():
            pass
        closed.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    closed.wait(float(request.get("max_seconds", DEFAULT_MAX_SECONDS)))
    for sock in listeners:
        sock.close()
    return 0


def _accept_loop(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # closed by serve()
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def _handle(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(30)
        try:
            mode = conn.recv(1)
            if mode == b"P":
                while data := conn.recv(64):
                    conn.sendall(data)
            elif mode == b"S":
                buffer = bytearray(CHUNK)
                total = 0
                while received := conn.recv_into(buffer):
                    total += received
                conn.sendall(struct.pack("!Q", total))
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# check


def check(request: dict[str, Any]) -> list[dict[str, Any]]:
    """Connect to every target in parallel, then measure throughput one target at a time."""
    targets = list(request.get("targets") or [])
    timeout = float(request.get("timeout", 2.5))
    results: list[dict[str, Any]] = [{} for _ in targets]

    def reach(index: int) -> None:
        results[index] = _reach(targets[index], timeout)

    threads = [threading.Thread(target=reach, args=(i,), daemon=True) for i in range(len(targets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for target, result in zip(targets, results, strict=True):
        if result.get("ok") and int(target.get("bytes") or 0) > 0:
            result.update(_throughput(target, timeout))
    return results


def _reach(target: dict[str, Any], timeout: float) -> dict[str, Any]:
    result: dict[str, Any] = {"name": target.get("name"), "addr": target["addr"],
                              "port": int(target["port"]), "ok": False}
    started = time.perf_counter()
    try:
        with socket.create_connection((target["addr"], int(target["port"])), timeout) as sock:
            result["connect_ms"] = (time.perf_counter() - started) * 1000
            pings = int(target.get("pings") or 0)
            if pings:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(b"P")
                rtts = []
                for _ in range(pings):
                    sent = time.perf_counter()
                    sock.sendall(b"x")
                    if not sock.recv(1):
                        raise ConnectionResetError(errno.ECONNRESET, "closed during ping")
                    rtts.append((time.perf_counter() - sent) * 1000)
                result["rtt_ms"] = statistics.median(rtts)
        result["ok"] = True
    except OSError as exc:
        result["error"], result["reason"] = _describe(exc)
    return result


def _throughput(target: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send up to ``bytes`` for up to ``seconds``; the receiver's count over the time to its
    answer is the rate (so bytes still in buffers are not counted as delivered)."""
    limit = int(target["bytes"])
    seconds = float(target.get("seconds") or 2.0)
    payload = memoryview(bytes(range(256)) * (CHUNK // 256))
    try:
        with socket.create_connection((target["addr"], int(target["port"])), timeout) as sock:
            sock.settimeout(seconds + 30)
            sock.sendall(b"S")
            started = time.perf_counter()
            sent = 0
            while sent < limit and time.perf_counter() - started < seconds:
                sock.sendall(payload[: min(CHUNK, limit - sent)])
                sent += min(CHUNK, limit - sent)
            sock.shutdown(socket.SHUT_WR)
            answer = b""
            while len(answer) < 8:
                part = sock.recv(8 - len(answer))
                if not part:
                    raise ConnectionResetError(errno.ECONNRESET, "no byte count from the receiver")
                answer += part
            elapsed = time.perf_counter() - started
        received = struct.unpack("!Q", answer)[0]
        return {"bytes": received, "seconds": elapsed, "gbits": received * 8 / elapsed / 1e9}
    except OSError as exc:
        error, _ = _describe(exc)
        return {"throughput_error": error}


def _describe(exc: OSError) -> tuple[str, str]:
    """(text, reason) for a failed connection; reason is timeout, refused, unreachable or error."""
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timed out", "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused", "refused"
    if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return exc.strerror or "unreachable", "unreachable"
    return exc.strerror or str(exc), "error"
