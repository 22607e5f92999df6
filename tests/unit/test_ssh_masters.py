"""Ending the ssh masters: a master that exited is gone, even while it waits, a zombie, for
the process that adopted it to reap it (some container inits reap seconds later, an
entrypoint that reaps nothing never does), so `herd` does not wait out its 2 s for it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def test_a_killed_launchers_empty_control_directory_is_removed_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGKILLed launcher cannot remove its control directory: the next launcher removes
    it once it is empty (its masters gone), and leaves a live launcher's alone."""
    import asyncio
    import tempfile

    from torchherd.spec import ClusterSpec, NodeSpec
    from torchherd.transport.ssh import CONTROL_PREFIX, SshTransport

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen(["true"])
    ended.wait()  # a pid that is gone
    dead_empty = tmp_path / f"{CONTROL_PREFIX}{ended.pid}-abcd1234"
    dead_busy = tmp_path / f"{CONTROL_PREFIX}{ended.pid}-efgh5678"
    live = tmp_path / f"{CONTROL_PREFIX}{os.getpid()}-ijkl9012"
    for folder in (dead_empty, dead_busy, live):
        folder.mkdir()
    (dead_busy / "socket-of-a-master-still-ending").touch()
    ssh = SshTransport(ClusterSpec(nodes=(NodeSpec(host="n1"),)))
    try:
        assert not dead_empty.exists()
        assert dead_busy.exists() and live.exists()
        made = [p.name for p in tmp_path.iterdir() if p.name.startswith(CONTROL_PREFIX)]
        assert sum(name.startswith(f"{CONTROL_PREFIX}{os.getpid()}-") for name in made) == 2
    finally:
        asyncio.run(ssh.close())
