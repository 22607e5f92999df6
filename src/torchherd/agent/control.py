"""Job control verbs on a node: `python -m torchherd.agent stop|status|logs|top`.

Each verb reads one JSON request on stdin and answers with JSON on stdout, so `herd stop`,
`herd ps`, `herd logs` and `herd top` work from any terminal, long after the launcher that
started the job is gone. Standard library only, like the rest of the agent.

Every agent writes ``agent.json`` (its pid and start time) into its node directory; that is how
`stop` finds the agent of a job (whose own environment carries no job tag) and asks it to end
the job the normal way, so its last event says "stopped" instead of "killed by SIGTERM".
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from ..files import write_private
from . import processes
from .protocol import encode

AGENT_FILE = "agent.json"
EVENTS_FILE = "events.jsonl"
# Seconds an asked agent gets beyond the job's grace period to end its job and report.
AGENT_MARGIN = 5.0


def herd_home(request: dict[str, Any]) -> str:
    home = request.get("herd_home") or os.environ.get("HERD_HOME") or "~/.herd"
    return os.path.expanduser(home)


def node_dir_for(request: dict[str, Any]) -> str:
    """The job's directory on this node: given, or the agent's default place."""
    given = request.get("node_dir")
    if given:
        return os.path.expanduser(str(given))
    return os.path.join(herd_home(request), "nodes", str(request["job_id"]), str(request["node"]))


# ---------------------------------------------------------------------------------------------
# The agent's own record


def _start_time(pid: int) -> int | None:
    """Process start time in clock ticks since boot, or None for a gone (or zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def write_agent_record(
    node_dir: str, job_id: str, node: str, detached: bool, attempt: str | None = None
) -> None:
    """Leave this agent's pid where `stop` and `top` find it; pid + start time name it uniquely."""
    pid = os.getpid()
    record = {
        "pid": pid,
        "start": _start_time(pid),
        "job_id": job_id,
        "node": node,
        "attempt": attempt,
        "detached": detached,
        "started_at": time.time(),
    }
    write_private(os.path.join(node_dir, AGENT_FILE), json.dumps(record))


def live_agent(node_dir: str, attempt: str | None = None) -> int | None:
    """The pid of the job's agent on this node while it runs (the agent of ``attempt`` only,
    when given); None once it is gone."""
    try:
        with open(os.path.join(node_dir, AGENT_FILE)) as handle:
            record = json.load(handle)
        pid, start = int(record["pid"]), record.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if attempt is not None and record.get("attempt") != attempt:
        return None  # a newer attempt's agent: not ours to end
    now = _start_time(pid)
    # A recycled pid has another start time: never signal a stranger.
    return pid if now is not None and now == start else None


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _start_time(pid) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------------------------------------
# stop


def stop(request: dict[str, Any]) -> dict[str, Any]:
    """End one job on this node: ask its agent, then sweep every tagged process; report.

    With an ``attempt`` (the launcher sweeping after a lost agent), only that attempt's agent
    and processes: a restart's may already be starting here.
    """
    job_id, node = str(request["job_id"]), str(request["node"])
    grace = float(request.get("grace", 10))
    attempt = None if request.get("attempt") is None else str(request["attempt"])
    node_dir = node_dir_for(request)
    found = processes.job_processes(job_id, node, attempt)
    agent = live_agent(node_dir, attempt)
    agent_ended = True
    if agent is not None:
        processes.signal_all([agent], signal.SIGTERM)
        agent_ended = _wait_gone(agent, grace + AGENT_MARGIN)
    survivors = processes.end_job(job_id, node, 0 if agent is not None else grace, attempt)
    if agent is not None and not agent_ended:
        processes.signal_all([agent], signal.SIGKILL)
        agent_ended = _wait_gone(agent, 5)
    return {
        "node": node,
        "agent": agent,
        "agent_left": not agent_ended,
        "processes": len(found),
        "survivors": survivors,
    }


# ---------------------------------------------------------------------------------------------
# status


def read_events(node_dir: str) -> list[dict[str, Any]]:
    """The control events of a detached job's node (lines left out: they can be many)."""
    events = []
    try:
        with open(os.path.join(node_dir, EVENTS_FILE), "rb") as handle:
            for raw in handle:
                if b'"e":"line"' in raw[:16]:
                    continue
                try:
                    event = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    events.append(event)
    except OSError:
        pass
    return events


def status(request: dict[str, Any]) -> dict[str, Any]:
    """Is the job alive on this node, and how did it end if it did."""
    job_id, node = str(request["job_id"]), str(request["node"])
    node_dir = node_dir_for(request)
    events = read_events(node_dir)
    exits = [e for e in events if e.get("e") == "exit"]
    errors = [e for e in events if e.get("e") == "error"]
    return {
        "node": node,
        "agent": live_agent(node_dir),
        "processes": len(processes.job_processes(job_id, node)),
        "exit": exits[-1] if exits else None,
        "error": errors[-1] if errors else None,
        "node_dir_exists": os.path.isdir(node_dir),
    }


# ---------------------------------------------------------------------------------------------
# logs


def kept_lines(request: dict[str, Any], out: Any) -> int:
    """A rank's lines kept on this node (a large job sends the launcher only some ranks'):
    torchrun's per-local-rank files of every attempt in which the rank ran here, as line
    events (each attempt's stdout, then its stderr)."""
    rank = int(request["rank"])
    node_dir = node_dir_for(request)
    sent = 0
    for attempt_dir in sorted(glob.glob(os.path.join(node_dir, "attempt-*")), key=_attempt_of):
        try:
            with open(os.path.join(attempt_dir, "ranks.json")) as handle:
                local = json.load(handle).get(str(rank))
        except (OSError, ValueError):
            continue
        if local is None:
            continue
        for stream, name in (("o", "stdout.log"), ("e", "stderr.log")):
            pattern = os.path.join(attempt_dir, "torchrun", "*", "attempt_*", str(local), name)
            for path in sorted(glob.glob(pattern)):
                with open(path, "rb") as handle:
                    for raw in handle:
                        text = raw.decode(errors="replace").rstrip("\r\n")
                        out.write(encode({"e": "line", "r": rank, "s": stream, "t": text}))
                        sent += 1
    out.flush()
    return 0 if sent else 1


def _attempt_of(path: str) -> int:
    try:
        return int(path.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def logs(request: dict[str, Any], out: Any = None, watch_stdin: bool = True) -> int:
    """Copy a detached job's events (``events.jsonl``) to stdout; with follow, until it ends.

    Only events are sent (one JSON line each), filtered by rank when asked, so the launcher
    formats them exactly like a live job's lines.
    """
    out = out or sys.stdout.buffer
    if request.get("kept") and request.get("rank") is not None:
        return kept_lines(request, out)
    node_dir = node_dir_for(request)
    path = os.path.join(node_dir, EVENTS_FILE)
    rank = request.get("rank")
    follow = bool(request.get("follow"))
    offset = int(request.get("offset", 0))
    if not os.path.exists(path):
        out.write(encode({"e": "error", "message": f"no events file {path} on this node"}))
        out.flush()
        return 1
    if follow and watch_stdin:
        _exit_when_stdin_closes()
    idle_since = time.monotonic()
    with open(path, "rb") as handle:
        handle.seek(offset)
        pending = b""
        while True:
            chunk = handle.read(1 << 16)
            if chunk:
                idle_since = time.monotonic()
                pending += chunk
                *lines, pending = pending.split(b"\n")
                ended = False
                for raw in lines:
                    ended = _send(out, raw, rank) or ended
                out.flush()
                if ended:
                    return 0
                continue
            if not follow:
                return 0
            # The agent writes its exit event last; a vanished agent that wrote none crashed.
            if live_agent(node_dir) is None and time.monotonic() - idle_since > 1.0:
                return 0
            time.sleep(0.2)


def _send(out: Any, raw: bytes, rank: int | None) -> bool:
    """Write one event if it passes the rank filter; True when it is the job's last event."""
    try:
        event = json.loads(raw)
    except ValueError:
        return False
    if not isinstance(event, dict):
        return False
    kind = event.get("e")
    if kind == "line" and rank is not None and event.get("r") != rank:
        return False
    out.write(raw + b"\n")
    return kind == "exit"


def _exit_when_stdin_closes() -> None:
    """A follower must not outlive the `herd logs -f` that started it."""

    def watch() -> None:
        while sys.stdin.buffer.read(1 << 12):
            pass
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


# ---------------------------------------------------------------------------------------------
# entry


def read_request(command: str) -> dict[str, Any] | None:
    """The one JSON request line a control command reads on stdin ({} for none); None, with
    the reason on stderr, for a line that is not JSON."""
    raw = sys.stdin.buffer.readline() if not sys.stdin.isatty() else b""
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        print(f"torchherd agent {command}: expected a JSON request on stdin", file=sys.stderr)
        return None


def main(command: str, argv: list[str]) -> int:
    request = read_request(command)
    if request is None:
        return 2
    if command == "logs":
        code = logs(request)
        sys.stdout.flush()
        # A follower's stdin watcher still blocks in a read; leave without waiting for it.
        os._exit(code)
    answer = stop(request) if command == "stop" else status(request)
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0
