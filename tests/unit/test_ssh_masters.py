"""Ending the ssh masters: a master that exited is gone, even while it waits, a zombie, for
the process that adopted it to reap it (some container inits reap seconds later, an
entrypoint that reaps nothing never does), so `herd` does not wait out its 2 s for it."""

from __future__ import annotations

import subprocess
import sys
import time

from torchherd.agent.workers import process_state
from torchherd.transport.ssh import _alive


def test_an_exited_process_that_nobody_reaped_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        # Not reaped (no wait): it stays a zombie, the state an exited master is in.
        while time.monotonic() < deadline:
            if process_state(child.pid) == "Z":
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the child did not exit within 30 s")
        assert not _alive(child.pid)
    finally:
        child.wait()
    assert not _alive(child.pid)  # reaped: gone from /proc


def test_a_running_process_is_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert _alive(child.pid)
    finally:
        child.kill()
        child.wait()
