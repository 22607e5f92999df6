"""Detached agents: the node's share of a job keeps running after the launcher goes away.

`herd launch --detach` sends the usual job request with ``"detach": true``. The agent then
daemonizes (fork, setsid, fork: no controlling terminal, not a child of the ssh session), and
the daemon runs the job exactly as an attached agent would, except that:
  - its events go to ``<node_dir>/events.jsonl`` (secret values masked) instead of stdout,
  - it ignores stdin (the launcher closes it at once) and ends the job only on SIGTERM, SIGINT
    or SIGHUP (what `herd stop` sends) or when the job exits by itself,
  - its own stdout/stderr (tracebacks, if any) go to ``<node_dir>/agent.log``.
The foreground agent waits for the daemon's first event ("started" or "error"), passes it to
the launcher on stdout and exits, which ends the ssh session: the launcher returns once every
node has said "started".
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

from ..files import private_dir
from .control import EVENTS_FILE
from .protocol import decode, encode

# How long the foreground agent waits for the daemon's first event.
START_TIMEOUT = 120.0


class FileEmitter:
    """Appends events to events.jsonl; relays the first start/error event to the launcher."""

    def __init__(self, path: str, relay_fd: int | None, secrets: list[str]) -> None:
        self._lock = threading.Lock()
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        self._fd = os.open(path, flags, 0o600)
        self._relay_fd = relay_fd
        # Values as they appear inside JSON text, too (quotes or backslashes get escaped there).
        forms = {s for s in secrets if len(s) >= 4}
        forms |= {json.dumps(s, ensure_ascii=False)[1:-1] for s in forms}
        self._secrets = sorted(forms, key=len, reverse=True)

    def __call__(self, event: dict[str, Any]) -> None:
        data = encode({**event, "ts": round(time.time(), 3)}).decode()
        for value in self._secrets:
            data = data.replace(value, "********")
        raw = data.encode()
        with self._lock:
            os.write(self._fd, raw)
            if self._relay_fd is not None and event.get("e") in ("started", "error", "exit"):
                try:
                    os.write(self._relay_fd, raw)
                finally:
                    os.close(self._relay_fd)
                    self._relay_fd = None


def run_detached(request: dict[str, Any]) -> int:
    """In the foreground agent: start the daemon, relay its first event, return an exit code."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:  # the intermediate child: new session, then leave the daemon orphaned
        try:
            os.close(read_fd)
            os.setsid()
            if os.fork() == 0:
                _daemon(request, write_fd)
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(child, 0)
    data = _read_until_closed(read_fd, START_TIMEOUT)
    events = [e for e in (decode(line) for line in data.splitlines()) if e is not None]
    if not events:
        events = [
            {
                "e": "error",
                "message": f"the detached agent on {request.get('node')} ended before starting "
                "the job",
                "remedy": "see agent.log in the job's node directory (~/.herd/nodes/JOB/NODE)",
            }
        ]
    for event in events:
        sys.stdout.buffer.write(encode(event))
    sys.stdout.flush()
    return 0 if events[0].get("e") == "started" else 3


def _read_until_closed(fd: int, timeout: float) -> bytes:
    import select

    chunks = []
    deadline = time.monotonic() + timeout
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = pipe.read(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def _daemon(request: dict[str, Any], relay_fd: int) -> None:
    """In the daemon: run the job to its end with events going to the node directory."""
    from .attempt import NodeAttempt, herd_home

    job = NodeAttempt(request, lambda _event: None)
    code = 1
    try:
        private_dir(job.node_dir, home=herd_home(dict(request.get("env", {}))))
        devnull = os.open(os.devnull, os.O_RDWR)
        log = os.open(
            os.path.join(job.node_dir, "agent.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
        )
        # Let go of the ssh session's pipes: the session ends when the foreground agent does.
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        secrets = [str(v) for v in dict(request.get("secret_env", {})).values()]
        job.emit = FileEmitter(os.path.join(job.node_dir, EVENTS_FILE), relay_fd, secrets)

        def stop(*_: object) -> None:
            job.request_stop("signal")

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, stop)
        code = job.run()
    except BaseException as exc:  # a daemon has nobody else to tell
        import traceback

        traceback.print_exc()
        try:
            job.emit({"e": "error", "message": f"detached agent failed: {exc}", "remedy": ""})
        except Exception:
            pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
