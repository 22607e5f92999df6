"""Files at rest are the user's alone; damaged records and node text do not break commands;
a failed detached start leaves nothing running.

Everything here runs for real on this machine: the job record, the launcher's log files, a
node agent (`python -m torchherd.agent run`) with its job, detached agents on the local
transport.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from torchherd.cli import main
from torchherd.cli.tables import result_table
from torchherd.logs import JobOutput
from torchherd.plan import LaunchPlan, NodePlan
from torchherd.records import JobRecord, job_dir, list_records
from torchherd.results import RunResult
from torchherd.spec import ClusterSpec, parse_host_list


@pytest.fixture(autouse=True)
def herd_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))
    # The usual umask: what a plain mkdir/open would give is 0755/0644.
    previous = os.umask(0o022)
    yield tmp_path / "home"
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def record(job_id: str, **fields: object) -> JobRecord:
    values: dict[str, object] = dict(
        id=job_id,
        state="succeeded",
        started=time.time() - 5,
        source="herd.toml",
        nodes=[{"host": "gpu1", "nproc": 1}],
        world_size=1,
        command=["python", "train.py"],
        rdzv_endpoint=None,
        log_dir=str(job_dir(job_id)),
        exit_code=0,
    )
    values.update(fields)
    return JobRecord(**values)  # type: ignore[arg-type]


# ---- item 2: modes -------------------------------------------------------------------------------


def test_launcher_job_directory_and_files_are_private(herd_home: Path) -> None:
    herd_home.mkdir(mode=0o755)  # as an older version left it
    job = record("1122-000000-aaaa")
    job.save()
    directory = job_dir(job.id)
    for path in (herd_home, herd_home / "jobs", directory):
        assert mode(path) == 0o700, path
    assert mode(directory / "job.json") == 0o600
    output = JobOutput(directory, ["gpu1"], 2, stream=io.StringIO())
    output.line("gpu1", 0, "step 1")
    output.line("gpu1", None, "torchrun says hello")
    output.close()
    for name in ("output.log", "rank-0.log", "node-gpu1.log"):
        assert mode(directory / name) == 0o600, name


def test_a_flush_reaches_the_files_and_an_idle_one_asks_the_writers_nothing(
    herd_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush makes the lines written since the last one reach the rank's file (without
    closing it); with nothing written, the writer threads are not woken (33 files flushed five
    times a second were a third of an idle launcher's CPU)."""
    output = JobOutput(herd_home / "jobs" / "j", ["gpu1"], 1, stream=io.StringIO())
    asked: list[str] = []

    def counted(part: object) -> None:
        real = part.flush  # type: ignore[attr-defined]

        def flush() -> None:
            asked.append(type(part).__name__)
            real()

        monkeypatch.setattr(part, "flush", flush)

    counted(output.files)
    counted(output.console)
    output.line("gpu1", 0, "step 1")
    output.flush()
    rank_log = herd_home / "jobs" / "j" / "rank-0.log"
    deadline = time.monotonic() + 10
    while "step 1" not in (rank_log.read_text() if rank_log.exists() else ""):
        assert time.monotonic() < deadline, "the flushed line never reached rank-0.log"
        time.sleep(0.02)
    assert sorted(asked) == ["Console", "LogFiles"]
    for _ in range(5):
        output.flush()
    assert len(asked) == 2, asked
    output.line("gpu1", 0, "step 2")
    output.flush()
    assert len(asked) == 4, asked
    output.close()
    assert rank_log.read_text().splitlines()[-1].endswith("step 2")


def test_a_running_attempts_loop_flushes_a_write_soon_after_it_with_nothing_written_next(
    herd_home: Path,
) -> None:
    """Once an attempt's loop flushes (flush_on), a line reaches its file within FLUSH_EVERY
    s though nothing is written after it; so does a line written before the loop was set."""
    output = JobOutput(herd_home / "jobs" / "j", ["gpu1"], 1, stream=io.StringIO())
    rank_log = herd_home / "jobs" / "j" / "rank-0.log"
    output.flush()
    output.line("gpu1", 0, "before the attempt")  # within FLUSH_EVERY of the flush: kept

    async def until_kept(line: str) -> None:
        deadline = time.monotonic() + 10
        while line not in (rank_log.read_text() if rank_log.exists() else ""):
            assert time.monotonic() < deadline, f"{line!r} never reached rank-0.log"
            await asyncio.sleep(0.02)

    async def attempt() -> None:
        output.flush_on(asyncio.get_running_loop())
        await until_kept("before the attempt")
        output.flush()
        output.line("gpu1", 0, "during the attempt")  # kept too, flushed later
        await until_kept("during the attempt")

    asyncio.run(attempt())
    output.close()


def test_a_chosen_log_dir_gets_private_files_and_keeps_its_own_mode(tmp_path: Path) -> None:
    from torchherd.files import open_private, private_dir

    chosen = tmp_path / "mine"
    chosen.mkdir(mode=0o750)
    output = JobOutput(chosen, ["gpu1"], 1, stream=io.StringIO())
    output.line("gpu1", 0, "x")
    output.close()
    assert mode(chosen) == 0o750
    assert mode(chosen / "output.log") == mode(chosen / "rank-0.log") == 0o600
    fresh = tmp_path / "new" / "deeper"
    private_dir(fresh)
    assert mode(fresh) == mode(fresh.parent) == 0o700
    loose = tmp_path / "loose.log"
    loose.write_text("old\n")
    loose.chmod(0o644)
    with open_private(loose) as handle:
        handle.write("new\n")
    assert mode(loose) == 0o600 and loose.read_text() == "old\nnew\n"


def test_node_directory_and_agent_files_are_private(tmp_path: Path) -> None:
    """A real node agent runs a job that leaves a failure record, as torchrun's wrapper does."""
    home = tmp_path / "nodehome"
    job_id = "1122-000000-" + uuid.uuid4().hex[:4]
    request = {
        "job_id": job_id,
        "node": "n1",
        "grace": 1,
        "env": {"HERD_HOME": str(home)},
        "argv": [
            sys.executable,
            "-c",
            "from torchherd.agent.elastic import _write_record; _write_record({'rank': 0})",
        ],
    }
    agent = subprocess.Popen(
        [sys.executable, "-m", "torchherd.agent", "run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert agent.stdin is not None and agent.stdout is not None
    agent.stdin.write(json.dumps(request) + "\n")
    agent.stdin.flush()  # and keep it open: a closed stdin means "the launcher is gone"
    events = []
    for line in agent.stdout:
        events.append(json.loads(line))
        if events[-1]["e"] == "exit":
            break
    agent.stdin.close()
    agent.wait(timeout=30)
    assert events[-1]["e"] == "exit" and events[-1]["code"] == 0, events
    node_dir = home / "nodes" / job_id / "n1"
    for path in (home, home / "nodes", home / "nodes" / job_id, node_dir, node_dir / "attempt-0"):
        assert mode(path) == 0o700, path
    assert mode(node_dir / "agent.json") == 0o600
    assert mode(node_dir / "attempt-0" / "failure.json") == 0o600


# ---- item 10: damaged job records, node text in tables ------------------------------------------


def test_a_damaged_job_record_is_skipped_with_a_warning(
    herd_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = record("1122-000001-good")
    good.save()
    Path(good.log_dir, "output.log").write_text("gpu1:0 | hello from the good job\n")
    damaged = {
        "1122-000002-trnc": '{"id": "1122-000002-trnc", "sta',
        "1122-000003-list": "[1, 2, 3]",
        "1122-000004-miss": '{"id": "1122-000004-miss"}',
        "1122-000005-type": json.dumps({**good.__dict__, "id": "1122-000005-type", "nodes": 3}),
    }
    for job_id, text in damaged.items():
        job_dir(job_id).mkdir(parents=True)
        (job_dir(job_id) / "job.json").write_text(text)
    assert main(["ps", "--no-refresh"]) == 0
    out, err = capsys.readouterr()
    assert good.id in out and "1122-000002" not in out
    for job_id in damaged:
        assert f"warning: skipping the job record {job_dir(job_id) / 'job.json'}" in err
    assert "Traceback" not in err
    assert [r.id for r in list_records()] == [good.id]

    assert main(["logs", "1122-000001"]) == 0
    assert "hello from the good job" in capsys.readouterr().out

    assert main(["stop", "1122-000004"]) == 2  # the damaged one cannot be stopped by id
    err = capsys.readouterr().err
    assert "error: no job '1122-000004'" in err and "fix:" in err


def test_node_text_is_shown_literally_in_tables() -> None:
    table = result_table(("HOST", "RESULT"))
    table.add_row("gpu1", "failed: [/] unbalanced")
    table.add_row("gpu2", "[red]not red[/red] [link=http://x]y[/link]")
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None).print(table)
    text = buffer.getvalue()
    assert "failed: [/] unbalanced" in text
    assert "[red]not red[/red] [link=http://x]y[/link]" in text


def test_an_unwritable_log_dir_is_an_error_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = main(["launch", "--log-dir", str(blocker / "logs"), "train.py"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: cannot write logs to --log-dir {blocker / 'logs'}: ")
    assert "\n  fix: " in err and "Traceback" not in err


# ---- item 9: a failed detached start stops every node that may have started --------------------


def _muted_b_cluster(tmp_path: Path) -> tuple[ClusterSpec, LaunchPlan]:
    """Nodes a and b on this machine (local transport), each starting ``sleep 60``. Node b's
    agent starts the job, but its answer never reaches the launcher (its python is a wrapper
    that throws the agent's stdout away, as a broken link would)."""
    muted = tmp_path / "muted-python"
    muted.write_text(f'#!/bin/sh\n"{sys.executable}" "$@" >/dev/null\n')
    muted.chmod(0o755)
    cluster = parse_host_list("a,b").model_copy(
        update={"transport": "local", "python": sys.executable}
    )
    cluster = cluster.model_copy(
        update={
            "nodes": (
                cluster.nodes[0],
                cluster.nodes[1].model_copy(update={"python": str(muted)}),
            )
        }
    )
    job_id = "1122-000000-" + uuid.uuid4().hex[:4]
    nodes = tuple(
        NodePlan(
            host=h,
            name=h,
            python=sys.executable,
            nproc=1,
            local_addr=None,
            iface=None,
            is_host=h == "a",
            argv=("sleep", "60"),
            env={},
        )
        for h in ("a", "b")
    )
    plan = LaunchPlan(
        job_id=job_id, rdzv_endpoint=None, world_size=2, nodes=nodes, workdir=None, grace=1.0
    )
    return cluster, plan


def _wait_gone(job_id: str) -> None:
    deadline = time.monotonic() + 10
    while _tagged(job_id) and time.monotonic() < deadline:
        time.sleep(0.2)


def test_a_failed_detached_start_stops_a_node_whose_answer_was_lost(tmp_path: Path) -> None:
    """b may be running the job although it never said so: it is stopped along with a."""
    from torchherd.launcher.detach import start_detached
    from torchherd.transport.local import LocalTransport

    cluster, plan = _muted_b_cluster(tmp_path)
    stream = io.StringIO()
    try:
        result = asyncio.run(start_detached(cluster, plan, LocalTransport(cluster), stream))
        assert result.exit_code == 3, stream.getvalue()
        assert "stopping the job on a, b" in stream.getvalue()
        _wait_gone(plan.job_id)
        assert _tagged(plan.job_id) == []
    finally:
        for pid in _tagged(plan.job_id):
            os.kill(pid, 9)


def test_a_time_limit_during_a_detached_start_stops_the_job_and_asks_for_a_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGUSR1 while the job starts: herd would leave right after, with nobody to ask the job
    to save, so it stops the job on every node and exits 5 (saved: requeue me). The signal
    comes while node a's start is on its way; the stop comes after a answered."""
    from torchherd.launcher.launch import LaunchOptions, Prepared, _start_detached
    from torchherd.transport.local import LocalTransport

    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))
    cluster, plan = _muted_b_cluster(tmp_path)
    # A node slow to start the job, not to stop it: its agent's start says it is on its way
    # (a marker file) and waits until the test lets it go (a release file).
    marker, release = tmp_path / "starting", tmp_path / "release"
    slow = tmp_path / "slow-python"
    slow.write_text(
        f'#!/bin/sh\ncase "$*" in *" run")\n  touch "{marker}"\n'
        f'  while [ ! -e "{release}" ]; do sleep 0.02; done ;;\nesac\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    slow.chmod(0o755)
    cluster = cluster.model_copy(
        update={"nodes": (cluster.nodes[0].model_copy(update={"python": str(slow)}),)}
    )
    plan = LaunchPlan(
        job_id=plan.job_id,
        rdzv_endpoint=None,
        world_size=1,
        nodes=plan.nodes[:1],
        workdir=None,
        grace=1.0,
    )
    prepared = Prepared(cluster=cluster, facts={}, secrets={}, plan=plan)
    stream = io.StringIO()

    async def time_limit_while_starting() -> None:
        while not marker.exists():  # node a's start is on its way
            await asyncio.sleep(0.02)
        # What Slurm's --signal=B:USR1@T does, now; node a answers once herd has heard it.
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 30  # a herd deaf to the signal fails below, not hangs
        while "while the job was starting" not in stream.getvalue():
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        release.touch()

    async def start() -> RunResult:
        loop = asyncio.get_running_loop()
        warning = asyncio.create_task(time_limit_while_starting())
        try:
            return await _start_detached(
                prepared, LaunchOptions(detach=True), LocalTransport(cluster), stream, loop
            )
        finally:
            release.touch()  # never leave node a waiting, whatever happened
            warning.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
                loop.remove_signal_handler(sig)

    try:
        result = asyncio.run(start())
        out = stream.getvalue()
        assert result.exit_code == 5, out
        assert "the time limit is near while the job was starting" in out, out
        assert "stopped before it trained" in out, out
        assert _tagged(plan.job_id) == [], out  # stopped, not merely signalled
    finally:
        for pid in _tagged(plan.job_id):
            os.kill(pid, 9)


def _tagged(job_id: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if f"HERD_JOB_ID={job_id}".encode() in environ.split(b"\0"):
            found.append(int(entry))
    return found
