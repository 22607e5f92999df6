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
other than 0, or by a signal that is not a request to stop, is written as one JSON line to a
pipe of its own that the node's agent gave the wrapper (``Notices``: its write end's number in
HERD_NOTICE_FD). Not the wrapper's stderr: torchrun copies the workers' output there, and a
progress bar's line (tqdm's, the Trainer's) is unfinished most of the time, so a notice written
after it would be glued to a rank's line. The agent tells the launcher at once (the
"worker-exit" event), which stops the other nodes then instead of after torchrun's exit. A
worker stopped by SIGTERM, SIGINT or SIGHUP was asked to stop (by torchrun, herd or the
scheduler): torchrun's own report covers it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

NOTICE_FD_VAR = "HERD_NOTICE_FD"
"""The wrapper's environment: the descriptor it writes its notice to (inherited from the agent)."""

# Signals that ask a process to stop: a worker that ends by one of them was stopped, not failed.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
# Seconds between looks while the wrapper has no child yet (its rendezvous, before the workers).
NO_CHILD_YET_S = 0.05
# Seconds between looks at a worker that ended well, until torchrun has reaped it.
UNREAPED_S = 0.02


class Notices:
    """The agent's end of a wrapper's notice pipe: ``pass_fds`` and ``env`` for the wrapper's
    Popen, then ``close_theirs()`` once it started, and ``read`` for the notices."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()  # neither is inherited but through pass_fds
        self.pass_fds = (self._write,)
        self.env = {NOTICE_FD_VAR: str(self._write)}

    def close_theirs(self) -> None:
        """The wrapper holds the write end now: the read ends when the wrapper has gone."""
        with contextlib.suppress(OSError):
            os.close(self._write)

    def read(self, told: Callable[[dict[str, Any]], None]) -> None:
        """Call ``told`` for each notice, until the wrapper (and any copy of the write end) has
        gone; closes the read end."""
        with os.fdopen(self._read, "rb") as pipe:
            for line in pipe:
                found = notice(line)
                if found is not None:
                    told(found)

    def discard(self) -> None:
        """A wrapper never started or thrown away: both ends closed."""
        self.close_theirs()
        with contextlib.suppress(OSError):
            os.close(self._read)


def watch_in_background() -> None:
    """The wrapper's side: watch this process's children from a daemon thread; the first bad
    end goes to the agent's pipe. Nothing without one (a wrapper run by hand)."""
    number = os.environ.pop(NOTICE_FD_VAR, "")  # popped: the workers never see it
    if not number.isdigit():
        return
    try:
        fd = int(number)
        os.set_inheritable(fd, False)
        pipe = os.fdopen(fd, "w")
    except OSError:
        return
    threading.Thread(target=_watch, args=(pipe,), name="herd-worker-exits", daemon=True).start()


def _watch(pipe: TextIO) -> None:
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
            with contextlib.suppress(OSError):
                pipe.write(json.dumps(told) + "\n")
                pipe.flush()
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
    from .workers import process_state  # here: the wrapper's start need not load it

    while process_state(pid) == "Z":  # "?" once reaped; another letter: the pid taken again
        time.sleep(UNREAPED_S)


def notice(line: bytes) -> dict[str, Any] | None:
    """One line of the notice pipe, read: the notice, or None for anything else."""
    try:
        told = json.loads(line)
    except ValueError:
        return None
    return told if isinstance(told, dict) and isinstance(told.get("pid"), int) else None
