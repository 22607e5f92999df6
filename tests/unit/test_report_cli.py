"""`herd report` and `herd init` as a user meets them: an output path that cannot be written is
one clear error (exit 2, no traceback), and `--open` hands the page to the browser $BROWSER
names (a real program here: a script that notes what it was asked to open)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from torchherd.cli import main
from torchherd.records import JobRecord


@pytest.fixture(autouse=True)
def herd_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


def saved_job(herd_home: Path) -> JobRecord:
    log_dir = herd_home / "jobs" / "1122-000000-abcd"
    log_dir.mkdir(parents=True)
    record = JobRecord(
        id="1122-000000-abcd", state="succeeded", started=time.time() - 10, source="herd.toml",
        nodes=[{"host": "gpu1", "nproc": 1}], world_size=1, command=["python"],
        rdzv_endpoint=None, log_dir=str(log_dir), ended=time.time(), exit_code=0,
    )  # fmt: skip
    record.save()
    return record


@pytest.mark.parametrize(
    "argv",
    [
        ["init", "-o", "/proc/nope.toml", "gpu1"],
        ["report", "1122-000000-abcd", "-o", "/proc/x.html"],
    ],
)
def test_an_output_path_that_cannot_be_written_is_a_usage_error(
    argv: list[str], herd_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved_job(herd_home)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "cannot write /proc/" in err and "-o" in err
    assert "Traceback" not in err


def test_open_hands_the_page_to_the_browser(
    herd_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = saved_job(herd_home)
    asked = tmp_path / "asked"
    browser = tmp_path / "browser"
    browser.write_text(f'#!/bin/sh\necho "$1" > {asked}\n')
    browser.chmod(0o755)
    monkeypatch.setenv("BROWSER", str(browser))
    monkeypatch.delenv("DISPLAY", raising=False)
    assert main(["report", record.id, "--open"]) == 0
    page = Path(record.log_dir) / "report.html"
    assert asked.read_text().strip() == page.as_uri()
    assert os.path.exists(page)


def test_logs_as_json_lines(herd_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    record = saved_job(herd_home)
    (Path(record.log_dir) / "output.log").write_text(
        "herd: job 1122-000000-abcd: 1 node(s)\n"
        "gpu1:0 | step 1 | loss 2.0\n"
        "gpu1   | W1124 agent line\n"
    )
    (Path(record.log_dir) / "rank-0.log").write_text("step 1 | loss 2.0\n")
    assert main(["logs", record.id, "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines == [
        {"host": None, "rank": None, "text": "herd: job 1122-000000-abcd: 1 node(s)"},
        {"host": "gpu1", "rank": 0, "text": "step 1 | loss 2.0"},
        {"host": "gpu1", "rank": None, "text": "W1124 agent line"},
    ]
    assert main(["logs", record.id, "--rank", "0", "--json"]) == 0
    one = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert one == [{"host": None, "rank": 0, "text": "step 1 | loss 2.0"}]
