"""Jobs as a user finds them again: named, listed with what ran, reached by a short id, a name
or "the latest", logs read from any directory, and only the chosen ranks on the console.

The launches here are real (this machine: agent, torchrun, Gloo), as `herd launch` runs them.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest

from tests.integration.herd_cli import herd
from torchherd.cli import main
from torchherd.logs import JobOutput
from torchherd.records import JobRecord, list_records

SCRIPT = """\
import os
print(f"rank {os.environ['RANK']} says {os.environ.get('GREETING')} as "
      f"{os.environ.get('HERD_JOB_NAME')}", flush=True)
"""


def test_a_named_job_with_relative_logs_is_found_again_from_anywhere(tmp_path: Path) -> None:
    project, elsewhere, home = tmp_path / "project", tmp_path / "elsewhere", tmp_path / "home"
    project.mkdir()
    elsewhere.mkdir()
    (project / "greet.py").write_text(SCRIPT)
    argv = ["launch", "--nproc", "2", "--name", "greet-1", "--env", "GREETING=hello"]
    run = herd([*argv, "--log-dir", "ro/logs", "greet.py", "--flag"], home, project, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "rank 1 says hello as greet-1" in run.stdout

    (record,) = json.loads(herd(["ps", "--json"], home, elsewhere, timeout=300).stdout)
    assert record["name"] == "greet-1" and record["what"] == "greet.py --flag"
    job_id = record["id"]
    # The relative --log-dir was kept as an absolute path: readable from another directory.
    assert Path(json.loads((home / "jobs" / job_id / "job.json").read_text())["log_dir"]) == (
        project / "ro" / "logs"
    )
    ps = herd(["ps"], home, elsewhere, timeout=300).stdout
    assert "greet-1" in ps and "greet.py --flag" in ps

    tail = job_id.rsplit("-", 1)[1]
    for who in (job_id, tail, "greet-1"):
        logs = herd(["logs", who, "--rank", "1"], home, elsewhere, timeout=300)
        assert logs.returncode == 0, logs.stderr
        assert logs.stdout.strip() == "rank 1 says hello as greet-1"
    latest = herd(["logs"], home, elsewhere, timeout=300)
    assert latest.returncode == 0, latest.stderr
    assert f"job {job_id} (the latest)" in latest.stderr
    assert "rank 0 says hello" in latest.stdout


def record(home: Path, job_id: str, *, kind: str = "job", name: str | None = None) -> JobRecord:
    entry = JobRecord(
        id=job_id,
        state="succeeded",
        started=time.time(),
        source="herd.toml",
        nodes=[{"host": "gpu1", "nproc": 1}],
        world_size=1,
        command=["python", "-m", "torchherd.agent.elastic"],
        rdzv_endpoint=None,
        log_dir=str(home / "jobs" / job_id),
        name=name,
        kind=kind,
        what="train.py",
    )
    entry.save()
    return entry


def test_herds_own_jobs_are_listed_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HERD_HOME", str(tmp_path))
    record(tmp_path, "1122-010101-aaaa")
    record(tmp_path, "1122-010102-bbbb", kind="doctor")
    record(tmp_path, "1122-010103-cccc", kind="bench")
    assert main(["ps", "--no-refresh"]) == 0
    shown = capsys.readouterr().out
    assert "1122-010101-aaaa" in shown
    assert "bbbb" not in shown and "cccc" not in shown
    assert main(["ps", "--all", "--no-refresh"]) == 0
    shown = capsys.readouterr().out
    assert "(doctor)" in shown and "(bench)" in shown
    # "the latest job" is the user's own, not herd's measuring job started after it
    assert [r.id for r in list_records()][-1] == "1122-010103-cccc"
    assert main(["logs", "--stacks"]) == 2
    assert "job 1122-010101-aaaa has no stacks" in capsys.readouterr().err


def test_short_ids_and_names_that_match_several_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HERD_HOME", str(tmp_path))
    record(tmp_path, "1122-010101-ab12", name="exp")
    record(tmp_path, "1122-010102-ab34", name="exp")
    assert main(["logs", "ab", "--stacks"]) == 2
    assert "ambiguous: 1122-010101-ab12, 1122-010102-ab34" in capsys.readouterr().err
    assert main(["logs", "ab3", "--stacks"]) == 2
    assert "job 1122-010102-ab34 has no stacks" in capsys.readouterr().err
    assert main(["logs", "exp", "--stacks"]) == 2  # a name: its latest job
    assert "job 1122-010102-ab34 has no stacks" in capsys.readouterr().err


def test_only_the_chosen_ranks_reach_the_console_and_every_rank_its_file(tmp_path: Path) -> None:
    console = io.StringIO()
    output = JobOutput(tmp_path, ["gpu1", "gpu2"], 4, stream=console, color=False, ranks={0, 3})
    for rank in range(4):
        output.line("gpu1" if rank < 2 else "gpu2", rank, f"step 1 on rank {rank}")
    output.line("gpu2", None, "torchrun: a line of the node itself")
    output.close()
    shown = console.getvalue()
    assert "rank 0" in shown and "rank 3" in shown
    assert "rank 1" not in shown and "rank 2" not in shown
    assert "a line of the node itself" in shown  # node lines (errors) always show
    for rank in range(4):
        assert (tmp_path / f"rank-{rank}.log").read_text() == f"step 1 on rank {rank}\n"
    assert (tmp_path / "output.log").read_text().count("step 1 on rank") == 4


def test_ranks_on_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchherd.cli.launch import parse_ranks

    assert parse_ranks("0,3-5") == frozenset({0, 3, 4, 5})
    assert parse_ranks(" 7 ") == frozenset({7})
    assert parse_ranks("all") is None and parse_ranks(None) is None


def test_a_large_job_sends_rank_0_unless_every_rank_is_asked_for() -> None:
    from torchherd.launcher.job import LARGE_JOB_NODES, sent_lines

    assert sent_lines(LARGE_JOB_NODES, None) is None  # a small job sends every line
    assert sent_lines(LARGE_JOB_NODES + 1, None) == {"ranks": [0], "stderr": True}
    assert sent_lines(100, frozenset({5, 2})) == {"ranks": [2, 5], "stderr": True}
    assert sent_lines(100, None, every_rank=True) is None  # --ranks all: really all


def test_stop_without_a_job_never_guesses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HERD_HOME", str(tmp_path))
    record(tmp_path, "1122-010101-aaaa")
    assert main(["stop"]) == 2
    assert "no running job to pick" in capsys.readouterr().err
    for job_id in ("1122-010102-bbbb", "1122-010103-cccc"):
        running = record(tmp_path, job_id)
        running.state = "running"  # attached, and its launcher (this process) is alive
        running.save()
    assert main(["stop"]) == 2
    err = capsys.readouterr().err
    assert "2 jobs are running: 1122-010102-bbbb, 1122-010103-cccc" in err
    assert "name the one you mean" in err


def test_ps_keeps_one_line_per_job_on_a_narrow_terminal() -> None:
    from rich.console import Console

    from torchherd.cli.jobs import ps_table

    header = ("ID", "NAME", "STATE", "NODES", "WORLD", "STARTED", "RUNTIME", "EXIT", "COMMAND")
    line = (
        "1122-023330-7016", "lr3e-4", "running (detached)", "gpu1,gpu2", "16", "11-22 02:33",
        "0:00:44", "-", "train.py --epochs 10 --lr 3e-4 --run-dir runs/long-experiment-name",
    )  # fmt: skip
    for width in (80, 200):
        buffer = io.StringIO()
        Console(file=buffer, width=width).print(ps_table(header, [line], width))
        shown = buffer.getvalue().splitlines()
        assert len(shown) == 2, shown  # a header and the job, nothing wrapped
        assert all(len(text) <= width for text in shown)
        assert "1122-023330-7016" in shown[1] and "running (detached)" in shown[1]
        assert "train.py --epochs" in shown[1]
    assert "gpu1,gpu2" in shown[1] and "--run-dir runs/long-experiment-name" in shown[1]
