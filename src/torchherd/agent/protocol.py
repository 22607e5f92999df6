"""JSON-lines protocol between the launcher and node agents (standard library only).

Launcher -> agent (stdin): first line the job request, then optional commands ({"cmd": "stop"}).
Closing stdin means "stop the job": the launcher died or its link dropped.

Agent -> launcher (stdout): one event per line. Keys are short because every worker line
travels as one event:
  {"e": "started", "host": ..., "pid": ..., "node_dir": ...}
  {"e": "line", "r": global_rank|null, "l": local_rank|null, "s": "o"|"e", "t": text}
  {"e": "exit", "code": int, "signal": name|null, "failures": [...], "stopped": bool}
  {"e": "error", "message": ..., "remedy": ...}      (the agent could not start the job)
  {"e": "beats", "b": [[rank, step, at, compute, wait, cycle, data], ...]}  (each rank's
                                                        newest progress beat)
  {"e": "alive"}                                      (only when the agent said nothing lately)
  {"e": "probe", "facts": {...}}   the quick probe, asked over the link before the job request
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
        value = json.loads(line)
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
