"""JSON-lines protocol between the launcher and node agents (standard library only).

Launcher -> agent (stdin): first line the job request, then optional commands ({"cmd": "stop"}).
Closing stdin means "stop the job": the launcher died or its link dropped.

Agent -> launcher (stdout): one event per line. Keys are short because every worker line
travels as one event:
  {"e": "started", "host": ..., "pid": ..., "node_dir": ...}
  {"e": "line", "r": global_rank|null, "l": local_rank|null, "s": "o"|"e", "t": text}
  {"e": "exit", "code": int, "signal": name|null, "failures": [...], "stopped": bool}
  {"e": "error", "message": ..., "remedy": ...}      (the agent could not start the job)
"""

from __future__ import annotations

import json
import re
from typing import Any

PROTOCOL_VERSION = 1

# torchrun prefixes each teed worker line with this template
# (TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE); the agent parses it back to know which rank wrote it.
LINE_PREFIX_TEMPLATE = "[herd ${rank} ${local_rank}] "
LINE_PREFIX = re.compile(r"^\[herd (\d+) (\d+)\] ?")

# Variables that tag every process of a job, so teardown finds them by job, never by name.
JOB_ID_VAR = "HERD_JOB_ID"
NODE_VAR = "HERD_NODE"


def encode(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def decode(line: bytes | str) -> dict[str, Any] | None:
    """One event, or None for a line that is not protocol (e.g. a shell's motd)."""
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def split_prefix(text: str) -> tuple[int | None, int | None, str]:
    """``[herd 3 1] hello`` -> (3, 1, "hello"); other lines -> (None, None, text)."""
    match = LINE_PREFIX.match(text)
    if not match:
        return None, None, text
    return int(match.group(1)), int(match.group(2)), text[match.end() :]


_MISSING_MODULE = re.compile(r"No module named '?([A-Za-z0-9_.]+)'?")


def missing_module(stderr: str) -> str | None:
    """The top-level module a node's python could not import, from its error output."""
    match = _MISSING_MODULE.search(stderr)
    return match.group(1).split(".")[0] if match else None
