"""`python -m torchherd.agent net session|check`: real TCP tests between nodes (stdlib only).

Rendezvous, NCCL and Gloo all need plain TCP between nodes: the store port on the rendezvous node
and ephemeral ports everywhere. A firewall that drops them shows up as a 10-minute hang at init,
so the doctor opens real listeners and makes real connections, with short timeouts, in parallel.

session The doctor's one process per node, a JSON-lines conversation on stdin/stdout:
        in  {"probe": {probe request}, "ports": {"ephemeral": 0, "rdzv": N}}
            (ephemeral 0: the kernel picks; rdzv 0: a free port in torchrun's range)
        out {"facts": {probe answer}, "ports": {name: port}, "errors": {name: why}}
        in  {"check": {check request}}  ->  out {"results": [...]}   (as often as asked)
        in  {"storage": {storage request}}  ->  out {"storage": {...}}   (see ``storage``)
        Listeners serve until stdin closes. One process per node, not one per step, keeps a
        doctor run to one ssh session per node.
check   First stdin line: {"targets": [{"name", "addr", "port", "pings", "bytes", "seconds"}],
        "timeout": s}. Connects to every target at once (latency from ``pings`` round trips),
        then measures throughput to each target that asked for it, one at a time so links do
        not share this node's NIC. Prints {"results": [...]} in target order.

A listener's connection says what it wants in its first byte: b"P" echo (latency), b"S" sink
(throughput: read to EOF, answer the byte count as 8 bytes); anything else is just accepted.
"""

from __future__ import annotations

import errno
import json
import random
import socket
import statistics
import struct
import sys
import threading
import time
from typing import IO, Any

from .probe import PORT_RANGE

CHUNK = 1 << 20
"""Bytes per send/recv in the throughput test."""


def main(argv: list[str]) -> int:
    verb = argv[0] if argv else ""
    line = sys.stdin.readline()
    request = json.loads(line) if line.strip() else {}
    if verb == "session":
        return session(request, sys.stdin, sys.stdout)
    if verb == "check":
        print(json.dumps({"results": check(request)}), flush=True)
        return 0
    print("usage: python -m torchherd.agent net session|check", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------
# serve


def listen(ports: dict[str, int]) -> tuple[list[socket.socket], dict[str, int], dict[str, str]]:
    """Open the listeners; a port of 0 is the kernel's pick, except "rdzv" 0: a free port in
    torchrun's range (as `herd launch` picks), bound at once so nothing can take it meanwhile."""
    listeners: list[socket.socket] = []
    bound: dict[str, int] = {}
    errors: dict[str, str] = {}
    for name, port in ports.items():
        candidates = [int(port)]
        if name == "rdzv" and not port:
            start = random.randrange(PORT_RANGE[1] - PORT_RANGE[0])
            span = list(range(*PORT_RANGE))
            candidates = span[start:] + span[:start]
        for candidate in candidates:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            # Like the TCPStore: a port in TIME_WAIT counts as free, one with a listener does not.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("", candidate))
                sock.listen(256)
            except OSError as exc:
                sock.close()
                errors[name] = exc.strerror or str(exc)
                continue
            errors.pop(name, None)
            listeners.append(sock)
            bound[name] = sock.getsockname()[1]
            break
    for sock in listeners:
        threading.Thread(target=_accept_loop, args=(sock,), daemon=True).start()
    return listeners, bound, errors


def session(request: dict[str, Any], stdin: IO[str], stdout: IO[str]) -> int:
    """Probe, listen, then answer check requests until stdin closes; see the module docstring."""
    from . import storage
    from .probe import collect

    ports = dict(request.get("ports") or {"ephemeral": 0})
    listeners, bound, errors = listen(ports)
    probe_request = dict(request.get("probe") or {})
    probe_request.pop("port", None)  # the listener itself is the port check
    facts = collect(probe_request)
    if "rdzv" in ports:
        in_use = errors.get("rdzv", "").lower().startswith("address already in use")
        facts["port"] = {
            "port": bound.get("rdzv", int(ports["rdzv"])),
            "free": not in_use and "rdzv" in bound,
        }
    stdout.write(json.dumps({"facts": facts, "ports": bound, "errors": errors}) + "\n")
    stdout.flush()
    try:
        for line in stdin:
            if not line.strip():
                continue
            asked = json.loads(line)
            if "storage" in asked:
                answer: dict[str, Any] = {"storage": storage.handle(dict(asked["storage"] or {}))}
            else:
                answer = {"results": check(dict(asked.get("check") or {}))}
            stdout.write(json.dumps(answer) + "\n")
            stdout.flush()
    finally:
        storage.clean()
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
    result: dict[str, Any] = {
        "name": target.get("name"),
        "addr": target["addr"],
        "port": int(target["port"]),
        "ok": False,
    }
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
                # send, not sendall: on a slow link a whole chunk would overrun the time budget
                # (1 MiB takes 2 s at 4 Mbit/s); send returns as soon as some of it is queued.
                sent += sock.send(payload[: min(CHUNK, limit - sent)])
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
