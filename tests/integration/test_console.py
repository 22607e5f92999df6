"""The launcher's console must never end a job: a console that stops reading, a closed pipe,
a line longer than any reader's limit, and Ctrl-C typed in a real terminal (tmux)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.integration.herd_cli import SCRIPTS, herd
from tests.integration.herd_cli import one_worker_cluster as cluster
from tests.testbed import Testbed
from torchherd.noise import AFTER_VERDICT, ALWAYS


def record(home: Path) -> dict[str, object]:
    job = next((home / "jobs").iterdir())
    return json.loads((job / "job.json").read_text())


def herd_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "torchherd", "launch", *args]


# A worker line as the console and output.log show it: `node1:0 | text` (`node1 | text` for
# torchrun's own lines); herd's notes and the summary have no such prefix.
WORKER_LINE = re.compile(r"^node\d+(:\d+)? *\| ")
NOT_SHOWN = re.compile(r"\[herd: (\d+) line\(s\) not shown")


def test_a_console_that_stops_reading_does_not_stop_the_job(
    testbed: Testbed, tmp_path: Path
) -> None:
    path, home = cluster(testbed, tmp_path, ["node1", "node2", "node3"])
    process = subprocess.Popen(
        herd_argv("-c", str(path), "chatty.py", "--seconds", "25", "--rate", "400"),
        cwd=SCRIPTS,
        env=dict(os.environ, HERD_HOME=str(home)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # Unbuffered: communicate(timeout=...) reads the descriptor itself, and would miss
        # what a buffered readline() had read ahead.
        bufsize=0,
    )
    try:
        assert process.stdout is not None
        seen = b""
        while b"line 00000010" not in seen:  # every node is chatting now
            line = process.stdout.readline()
            assert line, "herd ended before its workers spoke"
            seen += line
        # Nobody reads for longer than the launcher's limit on a node's silence (10 s) and
        # half as long again: the pipe fills at once, and a launcher that writes to it on its
        # event loop stalls. Meanwhile the workers print more lines (3 x 400 a second) than
        # the console's queue holds (10,000).
        time.sleep(15)
        assert process.poll() is None, "herd ended while its console was not read"
        out = seen.decode() + process.communicate(timeout=180)[0].decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, out[-3000:]
    assert out.count("DONE rank=") == 3, out[-3000:]
    assert record(home)["state"] == "succeeded"
    log = (Path(str(record(home)["log_dir"])) / "output.log").read_text().splitlines()
    # output.log holds exactly the lines each rank printed (each rank says how many).
    printed = {int(m[0]): int(m[1]) for m in re.findall(r"DONE rank=(\d+) lines=(\d+)", out)}
    assert sorted(printed) == [0, 1, 2]
    for rank, count in printed.items():
        assert sum(f"| rank {rank} line " in line for line in log) == count, (rank, count)
    # The console showed some worker lines, left the others out, and said how many: the
    # lines shown plus those counted are every worker line of the job but torch's known
    # chatter, which the console never shows (torchherd.noise; c10d's reverse lookup here),
    # and torch's dying words once herd has given its verdict (a torchrun whose exit barrier
    # lost the store of a node that finished first prints a traceback: not every run).
    shown = sum(bool(WORKER_LINE.match(line)) for line in out.splitlines())
    left_out = [int(n) for n in NOT_SHOWN.findall(out)]
    assert left_out and sum(left_out) > 0, out[-3000:]
    # (The console judges a line's text, without the node's prefix.)
    texts = [line.split("| ", 1)[1] for line in log if WORKER_LINE.match(line)]
    worker_lines = [text for text in texts if not ALWAYS.search(text)]
    dying_words = sum(bool(AFTER_VERDICT.search(text)) for text in worker_lines)
    accounted = shown + sum(left_out)
    assert len(worker_lines) - dying_words <= accounted <= len(worker_lines), (
        accounted,
        len(worker_lines),
        dying_words,
    )


def test_a_closed_pipe_and_a_huge_line_end_nothing(testbed: Testbed, tmp_path: Path) -> None:
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    command = " ".join(
        [
            *herd_argv("-c", str(path), "chatty.py", "--seconds", "3", "--huge-line", "17"),
            "| head -c 100 >/dev/null",
        ]
    )
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        cwd=SCRIPTS,
        env=dict(os.environ, HERD_HOME=str(home)),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert "Traceback" not in done.stderr, done.stderr
    saved = record(home)
    assert saved["state"] == "succeeded", (saved, done.stderr)
    rank0 = Path(str(saved["log_dir"])) / "rank-0.log"
    assert rank0.stat().st_size > 17 << 20  # the huge line arrived whole, in pieces
    assert "DONE rank=0" in rank0.read_text()[-2000:]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_ctrl_c_in_a_real_terminal_stops_every_node_cleanly(
    testbed: Testbed, tmp_path: Path
) -> None:
    path, home = cluster(testbed, tmp_path, ["node1", "node2", "node3"])
    log = tmp_path / "terminal.log"
    session = f"herd-test-{os.getpid()}"
    command = " ".join(herd_argv("-c", str(path), "allreduce.py", "--sleep", "300"))
    env = f"HERD_HOME={home} PYTHONUNBUFFERED=1"
    subprocess.run(
        [
            "tmux",
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            "200",
            "-y",
            "50",
            f"cd {SCRIPTS} && {env} {command} 2>&1 | tee -i {log}; sleep 600",
        ],
        check=True,
        timeout=30,
    )
    try:
        deadline = time.monotonic() + 180
        while not (log.exists() and log.read_text().count("SLEEPING") == 3):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no output"
            time.sleep(0.2)
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True, timeout=10)
        deadline = time.monotonic() + 10 + 25 + 15  # grace + 25 s, as the README promises
        while "logs: " not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], timeout=10, check=False)
    out = log.read_text()
    assert "interrupted" in out, out
    assert "lost" not in out and "ssh -v" not in out, out
    for node in ("node1", "node2", "node3"):
        assert f"{node}  stopped" in out, out
    assert record(home)["state"] == "stopped"


def tmux_screen(session: str, escapes: bool) -> str:
    """Everything the tmux session's terminal showed (its whole history); with ``escapes``,
    the colours as SGR sequences."""
    args = ["tmux", "capture-pane", "-p", "-J", "-S", "-", "-t", session]
    done = subprocess.run(
        [*args, *(["-e"] if escapes else [])], capture_output=True, text=True, timeout=10
    )
    return done.stdout


# An SGR sequence that sets a colour (tmux writes 36 as `\x1b[36m`, maybe with attributes).
COLOUR = re.compile(r"\x1b\[([0-9;]*)m")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_prefixes_are_coloured_on_a_terminal_and_plain_in_a_pipe(
    testbed: Testbed, tmp_path: Path
) -> None:
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    session = f"herd-colour-{os.getpid()}"
    command = " ".join(herd_argv("-c", str(path), "allreduce.py"))
    shell = f"cd {SCRIPTS} && HERD_HOME={home} {command}; echo HERD-EXIT=$?; sleep 600"
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, "-x", "250", "-y", "50", shell],
        check=True,
        timeout=30,
    )
    try:
        deadline = time.monotonic() + 180
        while "HERD-EXIT=" not in tmux_screen(session, escapes=False):
            assert time.monotonic() < deadline, tmux_screen(session, escapes=False)
            time.sleep(0.2)
        plain, coloured = tmux_screen(session, False), tmux_screen(session, True)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], timeout=10, check=False)
    assert "HERD-EXIT=0" in plain, plain
    colours = {}
    for line in coloured.splitlines():
        match = re.search(r"(node\d):(\d) *(\x1b\[[0-9;]*m)? *\| RESULT", line)
        if match:
            # The prefix is printed inside a colour that is set before it and reset after it.
            before = COLOUR.findall(line[: match.start(1)])
            assert before and before[-1] not in ("", "0"), repr(line)
            assert match.group(3), repr(line)
            colours[match.group(1)] = before[-1]
    assert sorted(colours) == ["node1", "node2"], coloured
    assert colours["node1"] != colours["node2"]  # one colour per node

    # The same job with its output in a pipe: the same prefixes, and no escape sequence.
    piped = herd(["launch", "-c", str(path), "allreduce.py"], home, SCRIPTS)
    assert piped.returncode == 0, piped.stdout + piped.stderr
    assert re.search(r"^node1:0 *\| RESULT", piped.stdout, re.M), piped.stdout
    assert re.search(r"^node2:1 *\| RESULT", piped.stdout, re.M), piped.stdout
    assert "\x1b" not in piped.stdout + piped.stderr


def test_a_closed_terminal_stops_the_job_and_leaves_nothing(
    testbed: Testbed, tmp_path: Path
) -> None:
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    # A private TMPDIR (short: ssh control sockets live in it) shows what the launcher left.
    scratch = Path(tempfile.mkdtemp(prefix="h", dir="/tmp"))
    process = subprocess.Popen(
        herd_argv("-c", str(path), "allreduce.py", "--sleep", "300"),
        cwd=SCRIPTS,
        env=dict(os.environ, HERD_HOME=str(home), PYTHONUNBUFFERED="1", TMPDIR=str(scratch)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        sleeping = 0
        for line in process.stdout:
            sleeping += "SLEEPING" in line
            if sleeping == 2:
                break
        control = list(scratch.glob("herd-ssh-*"))
        assert control, "no control directory while the job runs"
        # The ssh control sockets are private to the user, whatever the umask.
        assert all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in control), control
        process.send_signal(signal.SIGHUP)
        out = process.communicate(timeout=60)[0]
        assert process.returncode == 130, out
        assert record(home)["state"] == "stopped", out
        assert not list(scratch.iterdir()), list(scratch.iterdir())
        assert not testbed.processes_with_env("HERD_JOB_ID", str(record(home)["id"]))
    finally:
        if process.poll() is None:
            process.kill()
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_full_log_disk_does_not_stop_the_job(testbed: Testbed, tmp_path: Path) -> None:
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    try:
        done = subprocess.run(
            herd_argv("-c", str(path), "--log-dir", str(small), "chatty.py", "--seconds", "3"),
            cwd=SCRIPTS,
            env=dict(os.environ, HERD_HOME=str(home)),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        subprocess.run(["umount", str(small)], check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # Said once, however many lines and flushes met the full disk afterwards.
    assert done.stdout.count("cannot write the job's logs") == 1, done.stdout[-2000:]
    assert "No space left on device" in done.stdout
    assert done.stdout.count("DONE rank=") == 2
    assert record(home)["state"] == "succeeded"


def ssh_children(parent: int) -> list[str]:
    """Command lines of the ssh clients ``parent`` started (its direct children)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        program = os.path.basename(cmdline.split(" ", 1)[0])
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and program == "ssh":
            found.append(cmdline)
    return found


def test_a_time_limit_before_the_start_starts_nothing(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    testbed = clean_faults
    path, home = cluster(testbed, tmp_path, ["node1", "node2"])
    testbed.partition("node2")  # connecting to node2 waits for its timeout
    process = subprocess.Popen(
        herd_argv("-c", str(path), "allreduce.py"),
        cwd=SCRIPTS,
        env=dict(os.environ, HERD_HOME=str(home)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any("node2" in c for c in ssh_children(process.pid)):
            assert time.monotonic() < deadline and process.poll() is None, "never connected"
            time.sleep(0.05)
        process.send_signal(signal.SIGUSR1)
        out = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 5, out
    assert "the job was not started" in out and "Traceback" not in out, out
    assert not (home / "jobs").exists() or not list((home / "jobs").iterdir())
