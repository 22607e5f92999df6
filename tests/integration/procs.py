"""Watching what herd starts, for the teardown and secrets tests.

``ProcessWatch`` samples every process's command line while a herd command runs (a background
thread, every 20 ms; a process is read on its first ten samples, then on every tenth), so
short-lived ssh clients and the ssh ControlMasters that detach from herd are seen too.
``leftovers`` then names everything herd started that is still alive: ssh clients and masters
on the launcher, their private control directories (/tmp/herd-ssh-*), and any process on the
nodes (agents, torchrun, workers, sshd sessions), not only those tagged with the job id.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tests.testbed import Testbed

_CONTROL_PATH = re.compile(rb"ControlPath=(\S+)/[^/]+$")
# Samples (20 ms apart) during which a new process is read every time; afterwards every tenth.
_FRESH_SAMPLES = 10


def cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def environ(pid: int) -> set[bytes]:
    """The process's environment as KEY=VALUE entries (empty for one that is gone)."""
    try:
        return set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    except OSError:
        return set()


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _start_time(pid: int) -> str | None:
    """The start time of a running process; None for one that is gone or has exited (a
    zombie waits for whoever adopted it to reap it: a master that herd ended is gone, though
    this machine's init reaps it seconds later)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]  # field 22: start time, tells reused pids apart


def running(pid: int) -> bool:
    """Whether the pid is a process that still runs (not gone, not an unreaped zombie)."""
    return _start_time(pid) is not None


def _text(argv: bytes) -> str:
    return argv.replace(b"\0", b" ").decode(errors="replace").strip()


def all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


@dataclass
class ProcessWatch:
    """Samples command lines in the background between ``start()`` and ``stop()``."""

    testbed: Testbed
    secrets: tuple[str, ...] = ()
    """Values that must never appear on any command line."""
    ssh_clients: dict[int, tuple[str | None, bytes]] = field(default_factory=dict)
    """Launcher-side ssh processes using the testbed's ssh config: pid -> (start time, argv)."""
    control_dirs: set[str] = field(default_factory=set)
    leaked: list[tuple[int, str]] = field(default_factory=list)
    """(pid, command line) of every process seen with a secret on its command line."""
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _before: set[int] = field(default_factory=set)

    def __enter__(self) -> ProcessWatch:
        # Only what starts from now on is herd's: older ssh clients (another test's masters
        # waiting out ControlPersist) are not this run's.
        self._before = set(all_pids())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        config = str(self.testbed.ssh_config).encode()
        secrets = [s.encode() for s in self.secrets]
        first_seen: dict[int, int] = {}
        while not self._stop.is_set():
            for pid in all_pids():
                # A process is read on each of its first samples (a fork execs its program a
                # moment later), then on every tenth: the scan costs a few reads per new
                # process instead of one per process every 20 ms, CPU the timing tests need.
                age = self.samples - first_seen.setdefault(pid, self.samples)
                if age >= _FRESH_SAMPLES and self.samples % _FRESH_SAMPLES:
                    continue
                argv = cmdline(pid)
                if not argv:
                    continue
                if (
                    config in argv.split(b"\0")
                    and pid not in self.ssh_clients
                    and pid not in self._before
                ):
                    self.ssh_clients[pid] = (_start_time(pid), argv)
                    for arg in argv.split(b"\0"):
                        match = _CONTROL_PATH.search(arg)
                        if match:
                            self.control_dirs.add(match.group(1).decode())
                for secret in secrets:
                    if secret in argv:
                        self.leaked.append(
                            (pid, argv.replace(b"\0", b" ").decode(errors="replace"))
                        )
            self.samples += 1
            self._stop.wait(0.02)

    def ssh_to(self, host: str) -> list[int]:
        """Live ssh clients seen so far whose destination is ``host``."""
        return [
            pid
            for pid, (_, argv) in list(self.ssh_clients.items())
            if host.encode() in argv.split(b"\0") and cmdline(pid) == argv
        ]

    def leftovers(self, nodes: Iterable[str]) -> list[str]:
        """Everything herd started that is still alive, one line each (empty: all gone)."""
        found = []
        for pid, (started, argv) in list(self.ssh_clients.items()):
            if _start_time(pid) == started and started is not None:
                found.append(f"launcher: ssh {pid}: {_text(argv)}")
        found += [f"launcher: control directory {d}" for d in self.control_dirs if Path(d).exists()]
        for node in nodes:
            for pid in self.testbed.node_processes(node):
                if pid in self._before:
                    continue  # not this run's (e.g. sshd still holding an earlier dead link)
                found.append(f"{node}: {pid}: {_text(cmdline(pid) or b'')}")
        return found


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def assert_all_stopped(watch: ProcessWatch, nodes: Iterable[str], settle: float = 3.0) -> None:
    """Nothing herd started is alive, allowing ``settle`` seconds for sshd sessions on the nodes
    to notice their client is gone (the launcher side must be clean at once)."""
    nodes = list(nodes)
    launcher = [line for line in watch.leftovers(nodes) if line.startswith("launcher")]
    assert not launcher, "left on the launcher when herd exited:\n" + "\n".join(launcher)
    deadline = time.monotonic() + settle
    left = watch.leftovers(nodes)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = watch.leftovers(nodes)
    assert not left, "left behind:\n" + "\n".join(left) + _evidence(watch, nodes)


def _evidence(watch: ProcessWatch, nodes: list[str]) -> str:
    """What each process left behind was doing (state, kernel wait, Python stacks), so that a
    teardown failure seen once in CI explains itself."""
    parts = []
    for node in nodes:
        for pid in watch.testbed.node_processes(node):
            if pid in watch._before:
                continue
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
            except OSError:
                continue
            state, parent = fields[0], fields[1]
            parts.append(f"\n--- {node}: {pid}: state {state}, parent {parent}, wchan {wchan}")
            tool = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
            if b"python" in (cmdline(pid) or b"") and Path(tool).exists():
                try:
                    dumped = subprocess.run(
                        [tool, "dump", "--pid", str(pid)],
                        capture_output=True,
                        text=True,
                        timeout=20,
                    )
                    parts.append(dumped.stdout[-4000:] + dumped.stderr[-1000:])
                except subprocess.TimeoutExpired:
                    parts.append("py-spy took longer than 20 s")
    return "".join(parts)
