"""torch's chatter left out of the console and kept in the log files: lines torch prints on
every node whatever happens (c10d's reverse lookup, the agent's shutdown, C++ frames), and,
once herd has given its verdict, the warnings and errors of the ranks it is stopping. The
lines are torch 2.13's, as its agents and ranks print them when herd stops a job."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from torchherd.logs import JobOutput

ALWAYS = [
    "[W1124 16:02:11.412093 4107 torch/csrc/distributed/c10d/socket.cpp:767] [c10d] The hostname "
    "of the client socket cannot be retrieved. err=-3",
    "W1124 16:02:14.901000 4098 torch/distributed/elastic/agent/server/api.py:725] Received 15 "
    "death signal, shutting down workers",
    "W1124 16:02:14.902000 4098 torch/distributed/elastic/multiprocessing/api.py:908] Sending "
    "process 4107 closing signal SIGTERM",
    "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
    "Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:682 (most "
    "recent call first):",
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f3c1b2c8c48 in "
    "/venv/lib/python3.11/site-packages/torch/lib/libc10.so)",
    "frame #1: <unknown function> + 0x5d4b2ae (0x7f3c0a94b2ae in /venv/lib/python3.11/"
    "site-packages/torch/lib/libtorch_cpu.so)",
    # torchft as a replica group heals
    "[group0:4aa9a447-823f-4ae1-8b27-b36f819078ef/1 - step 142] Unable to reset NCCL flight "
    "recorder recording so traces will be incorrect.",
    '::ffff:10.155.192.14 - - [25/Nov/2026 06:25:39] "GET /checkpoint/142/full HTTP/1.1" 200 -',
    "/venv/lib/python3.11/site-packages/torch/distributed/_serialization.py:63: UserWarning: The "
    "given buffer is not writable, and PyTorch does not support non-writable tensors.",
    "  storage = torch.frombuffer(",
]
STOPPING = [
    "[W1124 16:02:15.100270 4107 torch/csrc/distributed/c10d/TCPStore.cpp:138] [c10d] recvVector "
    "failed on SocketImpl(fd=5, addr=[node2]:40332, remote=[node1]:29500): Connection reset by "
    "peer",
    "terminate called after throwing an instance of 'c10::DistNetworkError'",
]
USER = [
    "step 40 loss 0.2310",
    "Traceback (most recent call last):",
    '  File "train.py", line 9, in <module>',
    "ValueError: bad value 42",
]


@pytest.fixture
def output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[JobOutput, io.StringIO]:
    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))
    stream = io.StringIO()
    return JobOutput(tmp_path / "home" / "jobs" / "j", ["node1", "node2"], 2, stream=stream), stream


def test_torchs_chatter_is_kept_in_the_files_not_on_the_console(
    output: tuple[JobOutput, io.StringIO],
) -> None:
    job, stream = output
    job.lines("node2", [(1, line) for line in [*USER[:1], *ALWAYS[:1], *STOPPING]])
    job.lines("node2", [(None, line) for line in ALWAYS[1:]])
    job.verdict_given()
    job.lines("node2", [(1, line) for line in STOPPING + USER[1:]])
    job.close()
    console = stream.getvalue()
    for line in ALWAYS:
        assert line not in console
    # before the verdict a c10d error may be the first sign of a failure: shown once;
    # after it, the stopping ranks' errors are left out
    for line in STOPPING:
        assert console.count(line) == 1, line
    for line in USER:
        assert line in console
    kept = (job.log_dir / "output.log").read_text()
    for line in ALWAYS + STOPPING + USER:
        assert line in kept
    assert (job.log_dir / "rank-1.log").read_text().count(STOPPING[0]) == 2
    assert ALWAYS[1] in (job.log_dir / "node-node2.log").read_text()
    # a new attempt's lines matter again
    job.attempt_started()
    assert job.chatter.shown(STOPPING[0]) and not job.chatter.shown(ALWAYS[0])


def test_a_status_line_covers_the_wait_for_the_first_worker_line_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real terminal (a pty): "herd: starting 4 worker(s) (N s)" is shown, replaced in
    place, until the first worker line, which clears it; the log files never see it."""
    import os
    import select
    import time

    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))
    master, slave = os.openpty()
    terminal = open(slave, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    job = JobOutput(tmp_path / "home" / "jobs" / "j", ["node1"], 1, stream=terminal, color=False)
    job.until_first_line("starting 4 worker(s)")
    seen = b""
    deadline = time.monotonic() + 30
    while b"starting 4 worker(s) (" not in seen and time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            seen += os.read(master, 4096)
    assert b"\r\x1b[Kherd: starting 4 worker(s) (" in seen, seen
    job.lines("node1", [(0, "hello from rank 0")])
    job.close()
    while select.select([master], [], [], 0.5)[0]:
        seen += os.read(master, 4096)
    terminal.close()
    os.close(master)
    after = seen.split(b"hello from rank 0")[0]
    assert after.endswith(b"\r\x1b[Knode1:0 | "), seen  # cleared before the worker line
    assert "starting" not in (job.log_dir / "output.log").read_text()


def test_no_status_line_off_a_terminal(output: tuple[JobOutput, io.StringIO]) -> None:
    job, stream = output
    job.until_first_line("starting 2 worker(s)")
    job.lines("node1", [(0, "hello")])
    job.close()
    assert "\x1b" not in stream.getvalue() and "starting" not in stream.getvalue()
