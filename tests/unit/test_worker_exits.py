"""torchrun's wrapper tells a worker's bad end the moment it happens (agent/worker_exits.py):
real child processes, watched from a process of their own (the watch waits for any child)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from torchherd.agent.worker_exits import NOTICE, bad_end, notice

# A parent like torchrun's wrapper: children that end in turn (the watch must pass over the
# ones that end well or are stopped, and tell the first bad end once), reaped as torchrun does.
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    from torchherd.agent.worker_exits import watch_in_background
    watch_in_background()
    for code in sys.argv[1:]:
        child = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(0.3)  # the watch sees it end before it is reaped
        child.wait()
        print(f"REAPED {child.returncode}", file=sys.stderr, flush=True)
    time.sleep(0.3)
    """
)


def run_parent(*codes: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PARENT, *codes], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


def test_the_first_bad_end_is_told_once_after_the_good_and_the_stopped_ones() -> None:
    said = run_parent(
        "pass",
        "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
        "raise SystemExit(3)",
        "raise SystemExit(4)",
    )
    told = [notice(line) for line in said if notice(line) is not None]
    assert len(told) == 1 and told[0] is not None and told[0]["code"] == 3, said
    # Told before the parent reaped it, and after the two children before it were reaped.
    assert [line.startswith(NOTICE) for line in said] == [False, False, True, False, False], said


def test_a_worker_killed_is_told_by_its_signal() -> None:
    said = run_parent("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    told = [notice(line) for line in said if notice(line) is not None]
    assert told and told[0] is not None and told[0]["signal"] == "SIGKILL", said


def test_what_ends_well_or_was_asked_to_stop_is_not_told() -> None:
    assert bad_end(10, os.CLD_EXITED, 0) is None
    assert bad_end(10, os.CLD_EXITED, 1) == {"pid": 10, "code": 1}
    for asked in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        assert bad_end(10, os.CLD_KILLED, asked) is None
    assert bad_end(10, os.CLD_DUMPED, signal.SIGSEGV) == {"pid": 10, "signal": "SIGSEGV"}


def test_only_the_wrappers_own_notice_is_read_as_one() -> None:
    assert notice(NOTICE + '{"pid": 5, "code": 2}') == {"pid": 5, "code": 2}
    assert notice("[rank0]: " + NOTICE + '{"pid": 5}') is None  # a worker's line
    assert notice(NOTICE + "not json") is None
    assert notice(NOTICE + '{"code": 2}') is None
