"""The wire protocol between the launcher and a node agent: JSON lines (standard library only).

This docstring is the one description of the protocol; both ends (agent/runner.py, agent/
attempt.py on the node; launcher/links.py, launcher/attempt/ on the launcher) follow it.

Launcher -> agent (`python -m torchherd.agent run`, stdin), in this order:

    {"probe": request}              optional, first: answered by one {"e": "probe"} event
    {"prewarm": spec}               optional: warm torchrun's wrapper before the request
    a job request                   the first attempt, run at once (launcher.attempt.request)
    then commands, any time:
    {"cmd": "run", "request": R}    run the next attempt (once the previous one has ended)
    {"cmd": "prewarm", "attempt": N}           warm a wrapper for attempt N now
    {"cmd": "stop", "stacks": bool, "next": N} end the attempt (stacks first when asked; warm a
                                               wrapper for attempt N meanwhile); the agent stays
    {"cmd": "kill"}                 end the attempt at once, no grace
    {"cmd": "save"}                 ask the workers to save a snapshot and stop
    {"cmd": "look", "id": N}        one look at every rank (the hang watch's evidence)
    {"cmd": "stacks"}               every worker's stacks (py-spy)
    {"cmd": "why-slow", "rank": R}  what the node can tell about why rank R is slow
    {"cmd": "port"}                 a free port on the node (a moved rendezvous)
    {"cmd": "ping"}                 nothing but proof that the launcher is there
    {"cmd": "bye"}, or stdin closed end the attempt, then exit

stop, kill, save, stacks and look may carry "attempt": N; then they act on attempt N only (one
for an earlier attempt is ignored, one for a later attempt waits until it starts there), so a
command never reaches the previous attempt. A launcher silent for the request's ``silence``
seconds is taken for gone: the agent ends the attempt (a partition closes nothing).

Agent -> launcher (stdout): one event per line; keys are short because worker lines travel
in them. "a" is the attempt, "r" a global rank, "host" the node:

    {"e": "probe", "facts": {...}}                the quick probe (facts.NodeFacts)
    {"e": "started", "host", "pid", "node_dir", "a"}      torchrun is running
    {"e": "lines", "b": [[r, local_rank, "o"|"e", text], ...]}  worker lines, batched
    {"e": "line", "r", "l", "s": "o"|"e", "t"}    one worker line (older agents; detach files)
    {"e": "spoke", "r": [ranks]}                  ranks whose lines the node kept (not sent);
                                                  a rank that beat in the same report only
                                                  the first time
    {"e": "dropped", "n": count}                  events dropped while the link was full
    {"e": "beats", "b": [[r, step, at, compute, wait, cycle, data], ...]}
                                                  each rank's newest progress beat
    {"e": "phase", "r", "name", "since", "limit"} a rank entered (or left) a declared phase
    {"e": "saved", "r", "step", "at", "where"}    a rank committed a snapshot
    {"e": "save-requested", "a", "host"}          the workers were asked to save and stop
    {"e": "look", "host", "a", "at", "ticks", "ranks": [...], "id"}  the answer to a look
    {"e": "why-slow", "a", "r", "causes": [...]}  the answer to why-slow
    {"e": "stacks", "a", "host", "reason", "at", "workers": [...]}  every worker's stacks
    {"e": "port", "port": int}                    the answer to port
    {"e": "worker-exit", "a", "host", "pid", "code" | "signal"}
                                                  a worker ended badly, told at once (before
                                                  torchrun's exit; agent/worker_exits.py)
    {"e": "exit", "a", "host", "code", "signal", "failures": [...], "stopped", ...}
                                                  the attempt ended on this node
    {"e": "error", "message", "remedy"}           the agent could not do what it was asked
    {"e": "alive"}                                only when the agent said nothing lately
"""

from __future__ import annotations

import json
import re
from typing import Any

PROTOCOL_VERSION = 1

# torchrun prefixes each teed worker line with this template
# (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE); the agent parses it back to know which rank wrote it.
LINE_PREFIX_TEMPLATE = "[herd ${rank} ${local_rank}] "
LINE_PREFIX = re.compile(r"\[herd (\d+) (\d+)\] ?")

# Variables that tag every process of a job, so teardown finds them by job, never by name;
# the attempt tells a restarted job's processes from those its lost predecessor left.
JOB_ID_VAR = "HERD_JOB_ID"
NODE_VAR = "HERD_NODE"
ATTEMPT_VAR = "HERD_ATTEMPT"


def encode(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def decode(line: bytes | str) -> dict[str, Any] | None:
    """One event, or None for a line that is not protocol (e.g. a shell's motd)."""
    try:
        # Bytes decoded here, not by json.loads: it would first guess their encoding, in
        # Python, for every event (UTF-8 is the protocol's).
        value = json.loads(line.decode() if isinstance(line, bytes) else line)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


RankLine = tuple[int | None, int | None, str]
"""(global rank, local rank, text); ranks are None for torchrun's own lines."""


class RankLines:
    """Rebuilds whole worker lines from torchrun's teed output (one instance per stream).

    torchrun's tee copies each rank's log file with readline(); caught mid-write, readline
    returns part of a line, which torchrun prints with the prefix and no newline, and the rest
    comes later under the prefix again:  ``[herd 0 0] RESULT sum=1[herd 0 0] 0\n``.
    So a prefixed piece followed by another prefix on the same output line is unfinished and
    waits for the rest of its rank's line; the piece before the newline ends a line.
    """

    def __init__(self) -> None:
        self._pending: dict[int, str] = {}

    def feed(self, text: str) -> list[RankLine]:
        """One output line of torchrun (without its newline) -> the complete lines it ends."""
        matches = list(LINE_PREFIX.finditer(text))
        if not matches:
            return [(None, None, text)]
        lines: list[RankLine] = []
        if matches[0].start() > 0:
            lines.append((None, None, text[: matches[0].start()]))
        for index, match in enumerate(matches):
            rank, local_rank = int(match.group(1)), int(match.group(2))
            last = index == len(matches) - 1
            piece = text[match.end() : len(text) if last else matches[index + 1].start()]
            if last:
                lines.append((rank, local_rank, self._pending.pop(rank, "") + piece))
            else:
                self._pending[rank] = self._pending.get(rank, "") + piece
        return lines

    def drain(self) -> list[RankLine]:
        """What is left unfinished when the stream ends."""
        left: list[RankLine] = [(rank, None, text) for rank, text in self._pending.items()]
        self._pending.clear()
        return left


_MISSING_MODULE = re.compile(r"No module named '?([A-Za-z0-9_.]+)'?")


def missing_module(stderr: str) -> str | None:
    """The top-level module a node's python could not import, from its error output."""
    match = _MISSING_MODULE.search(stderr)
    return match.group(1).split(".")[0] if match else None


def readable_failure(message: Any) -> tuple[str, str]:
    """A worker's failure message as a person reads it: (the exception line, its traceback).

    A worker that recorded its own exception (torch's ``@record``, the documented way to get
    it to the launcher) leaves torch's error file, and torch hands its JSON over as the
    message, a dict or its text: ``{"message": "ValueError: ...", "extraInfo": {"py_callstack":
    "Traceback..."}}``. Anything else is a plain message with no traceback.
    """
    if isinstance(message, str) and message.lstrip().startswith("{"):
        try:
            message = json.loads(message)
        except ValueError:
            return message, ""
    if isinstance(message, str):
        return message, ""
    if isinstance(message, dict) and isinstance(message.get("message"), str):
        extra = message.get("extraInfo")
        callstack = extra.get("py_callstack") if isinstance(extra, dict) else None
        return message["message"], callstack if isinstance(callstack, str) else ""
    return json.dumps(message), ""
