"""torchrun's wrapper tells a worker's bad end the moment it happens (agent/worker_exits.py):
real child processes, watched from a process of their own (the watch waits for any child),
its notices read from a real pipe as the node's agent reads them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

from torchherd.agent.worker_exits import Notices, bad_end, notice

# A parent like torchrun's wrapper: children that end in turn (the watch must pass over the
# ones that end well or are stopped, and tell the first bad end once), reaped as torchrun does.
PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from torchherd.agent.worker_exits import NOTICE_FD_VAR, watch_in_background
    watch_in_background()
    assert NOTICE_FD_VAR not in os.environ  # the workers never see it
    for code in sys.argv[1:]:
        child = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(0.3)  # the watch sees it end before it is reaped
        child.wait()
        print(f"REAPED {child.returncode} {time.time()}", file=sys.stderr, flush=True)
    time.sleep(0.3)
    """
)


def run_parent(*codes: str) -> tuple[list[tuple[float, dict[str, Any]]], dict[int, float]]:
    """The notices (with when they came) and when the parent reaped each exit code."""
    notices = Notices()
    told: list[tuple[float, dict[str, Any]]] = []
    reader = threading.Thread(target=notices.read, args=(lambda n: told.append((time.time(), n)),))
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, *codes],
        env=os.environ | notices.env,
        pass_fds=notices.pass_fds,
        stderr=subprocess.PIPE,
        text=True,
    )
    notices.close_theirs()
    reader.start()
    _, err = parent.communicate(timeout=60)
    reader.join(timeout=10)
    assert parent.returncode == 0 and not reader.is_alive(), err
    reaped = {int(w[1]): float(w[2]) for w in (line.split() for line in err.splitlines())}
    return told, reaped


def test_the_first_bad_end_is_told_once_after_the_good_and_the_stopped_ones() -> None:
    told, reaped = run_parent(
        "pass",
        "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
        "raise SystemExit(3)",
        "raise SystemExit(4)",
    )
    assert [n for _, n in told] == [{"pid": told[0][1]["pid"], "code": 3}], told
    assert sorted(reaped) == [-15, 0, 3, 4]
    # Told before the parent reaped that child: the moment it ended, not at the parent's look.
    assert told[0][0] < reaped[3], (told, reaped)


def test_a_worker_killed_is_told_by_its_signal() -> None:
    told, _ = run_parent("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert [n.get("signal") for _, n in told] == ["SIGKILL"], told


def test_what_ends_well_or_was_asked_to_stop_is_not_told() -> None:
    assert bad_end(10, os.CLD_EXITED, 0) is None
    assert bad_end(10, os.CLD_EXITED, 1) == {"pid": 10, "code": 1}
    for asked in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        assert bad_end(10, os.CLD_KILLED, asked) is None
    assert bad_end(10, os.CLD_DUMPED, signal.SIGSEGV) == {"pid": 10, "signal": "SIGSEGV"}


def test_only_a_notice_is_read_as_one() -> None:
    assert notice(b'{"pid": 5, "code": 2}\n') == {"pid": 5, "code": 2}
    assert notice(b"not json\n") is None
    assert notice(b'{"code": 2}\n') is None
    assert notice(b"[1, 2]\n") is None
