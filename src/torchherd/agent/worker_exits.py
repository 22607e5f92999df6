"""A worker's bad end, told the moment it happens (standard library only).

torchrun learns that a worker died at its next look (every 0.1 s), then ends the node's other
workers, stops tailing their logs (another 0.1 s poll) and only then exits with the failure:
0.25 s on an idle node, and as long as a sibling worker takes to answer SIGTERM (torchrun waits
up to 30 s) on a node where one is stuck. Until then the other nodes' ranks sit in a collective
that can never complete, and a restart waits for them to be stopped after it.

So herd's torchrun wrapper (agent/elastic.py) watches its children itself: torchrun's workers
are its only children (orphans go to the agent, a subreaper, not to the wrapper), and
``os.waitid(..., WNOWAIT)`` wakes the moment one of them ends, without reaping it: torchrun still
reaps it and reports the failure exactly as before. The first worker that ends with an exit code
other than 0, or by a signal that is not a request to stop, is written as one line on the
wrapper's stderr (``notice``); the node's agent takes that line off the stream and tells the
launcher at once (the "worker-exit" event), which stops the other nodes then instead of after
torchrun's exit. A worker stopped by SIGTERM, SIGINT or SIGHUP was asked to stop (by torchrun,
herd or the scheduler): torchrun's own report covers it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any, TextIO

NOTICE = "torchherd: worker exit "
"""The start of the wrapper's line for the agent (followed by JSON: pid, code or signal)."""

# Signals that ask a process to stop: a worker that ends by one of them was stopped, not failed.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
# Seconds between looks while the wrapper has no child yet (its rendezvous, before the workers).
NO_CHILD_YET_S = 0.05
# Seconds between looks at a worker that ended well, until torchrun has reaped it.
UNREAPED_S = 0.02


def watch_in_background(stream: TextIO | None = None) -> None:
    """Watch this process's children from a daemon thread; the first bad end goes to
    ``stream`` (stderr) as one ``NOTICE`` line."""
    threading.Thread(
        target=_watch, args=(stream or sys.stderr,), name="herd-worker-exits", daemon=True
    ).start()


def _watch(stream: TextIO) -> None:
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # no child yet (or between torchrun's reaps)
            time.sleep(NO_CHILD_YET_S)
            continue
        except OSError:
            return  # cannot watch here: torchrun's own report still comes
        if info is None:
            continue
        told = bad_end(info.si_pid, info.si_code, info.si_status)
        if told is not None:
            # One write of the whole line: torchrun's log tailers write to the same stream.
            stream.write(NOTICE + json.dumps(told) + "\n")
            stream.flush()
            return
        _until_reaped(info.si_pid)


def bad_end(pid: int, how: int, status: int) -> dict[str, Any] | None:
    """What to tell of a child that ended (waitid's si_code and si_status): None when it
    ended well or was asked to stop."""
    if how == os.CLD_EXITED:
        return {"pid": pid, "code": status} if status != 0 else None
    if how in (os.CLD_KILLED, os.CLD_DUMPED) and status not in STOP_SIGNALS:
        try:
            name = signal.Signals(status).name
        except ValueError:
            name = f"signal {status}"
        return {"pid": pid, "signal": name}
    return None


def _until_reaped(pid: int) -> None:
    """Wait until torchrun has reaped a child that ended well (WNOWAIT leaves it a zombie, and
    the next waitid would report it again)."""
    while True:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                state = handle.read().rsplit(")", 1)[-1].split()[0]
        except (OSError, IndexError):
            return
        if state != "Z":
            return  # reaped, and the pid already taken again
        time.sleep(UNREAPED_S)


def notice(text: str) -> dict[str, Any] | None:
    """The agent's side: the wrapper's notice in a line of its stderr, else None."""
    if not text.startswith(NOTICE):
        return None
    try:
        told = json.loads(text[len(NOTICE) :])
    except ValueError:
        return None
    return told if isinstance(told, dict) and isinstance(told.get("pid"), int) else None
