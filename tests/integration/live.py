"""`herd launch` as a live process in fault tests: its output read as it comes, what it started
watched (tests.integration.procs.ProcessWatch), and what it left checked.

Every fault test runs herd inside ``LiveHerd``: at ``finish()`` the process watch is stopped
and ``assert_clean()`` fails the test if an ssh client or control master of this launcher, or
any process on the nodes it used (agents, torchrun, workers, sshd sessions), is still there.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.integration.herd_cli import SCRIPTS
from tests.integration.procs import ProcessWatch, assert_all_stopped
from tests.testbed import Testbed


class LiveHerd:
    """`herd launch` as a running process whose output lines are read as they come."""

    def __init__(
        self, args: list[str], home: Path, testbed: Testbed | None = None, command: str = "launch"
    ) -> None:
        self.lines: list[tuple[float, str]] = []
        self._seen = threading.Condition()
        self.home = home
        self.watch = ProcessWatch(testbed).__enter__() if testbed is not None else None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "torchherd", command, *args],
            cwd=SCRIPTS,
            env=dict(os.environ, HERD_HOME=str(home), PYTHONUNBUFFERED="1"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._seen:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._seen.notify_all()

    def wait_for(self, pattern: str, timeout: float, count: int = 1) -> list[re.Match[str]]:
        """The first ``count`` matches of ``pattern``; fails with the output after timeout."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._seen:
            while True:
                found = [m for _, line in self.lines if (m := regex.search(line))]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                assert left > 0 and self.process.poll() is None or len(found) >= count, (
                    f"{pattern!r} not seen {count} time(s) in {timeout:g} s:\n{self.output}"
                )
                self._seen.wait(min(left, 0.5) if left > 0 else 0.5)

    def seen_at(self, pattern: str) -> float | None:
        regex = re.compile(pattern)
        return next((t for t, line in self.lines if regex.search(line)), None)

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def finish(self, timeout: float = 120) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            if self.watch is not None:
                self.watch.stop()

    def assert_clean(self, nodes: Iterable[str], settle: float = 60.0) -> None:
        """Nothing this herd started is left on the launcher or on ``nodes``. The launcher
        side must be clean at once; a node's agent and torchrun get ``settle`` seconds to
        notice herd is gone and end (a poll: a clean node costs nothing; on a machine running
        three testbeds a node's agent and torchrun were seen still ending 10 s, then 30 s,
        after the job)."""
        assert self.watch is not None, "LiveHerd was started without a testbed to watch"
        assert_all_stopped(self.watch, nodes, settle=settle)

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def record(self) -> dict[str, Any]:
        """The job's record (job.json) as herd left it."""
        return json.loads((self.home / "jobs" / job_id(self.home) / "job.json").read_text())


def job_id(home: Path) -> str:
    return next((home / "jobs").iterdir()).name


def pids(match: re.Match[str]) -> int:
    return int(match.group("pid"))


def assert_nothing_left(testbed: Testbed, job: str, within: float = 30.0) -> None:
    """No process of the job anywhere (namespaces share the pid space)."""
    deadline = time.monotonic() + within
    left = testbed.processes_with_env("HERD_JOB_ID", job)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = testbed.processes_with_env("HERD_JOB_ID", job)
    assert not left, f"processes of job {job} still running: {left}"


def stacks_of(home: Path, job: str) -> dict[str, str]:
    found = {}
    for path in (home / "jobs" / job / "stacks").rglob("*-rank-*.txt"):
        found[path.name] = path.read_text()
    return found


def resume(pid: int) -> None:
    """SIGCONT a process that may be gone already."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
