"""The report page's reading of a job: tolerant of old and newer records, and finding the
metrics the script wrote (given, from the job's --run-dir, or written under its workdir
while it ran). The page itself is looked at in a browser in tests/integration."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from torchherd.jobs import JobRecord, attempt_entry
from torchherd.story import find_metrics, gather, render, write_report


def job(tmp_path: Path, what: str = "train.py", **extra: object) -> JobRecord:
    log_dir = tmp_path / "jobs" / "1122-010101-abcd"
    log_dir.mkdir(parents=True)
    (log_dir / "rank-0.log").write_text("step 1\n")
    record = JobRecord(
        id="1122-010101-abcd",
        state="failed",
        started=time.time() - 100,
        source="herd.toml",
        nodes=[{"host": "gpu1", "nproc": 2}, {"host": "gpu2", "nproc": 2}],
        world_size=4,
        command=["python", "-m", "torchherd.agent.elastic"],
        rdzv_endpoint="10.0.0.1:29500",
        log_dir=str(log_dir),
        ended=time.time(),
        exit_code=1,
        cluster={"workdir": str(tmp_path / "project")},
        what=what,
        **extra,  # type: ignore[arg-type]
    )
    return record


def test_newer_keys_are_shown_and_missing_ones_tolerated(tmp_path: Path) -> None:
    first = attempt_entry(0, [{"host": "gpu1", "nproc": 2}], 4, None)
    first.update(outcome="lost", ended=first["started"] + 30, noticed="the node went silent")
    first["slow"] = [{"host": "gpu2", "rank": 3, "step_time": 1.9}]  # a key a newer herd adds
    second = {"n": 1, "nodes": [{"host": "gpu1", "nproc": 2, "steps_per_s": 2.5}]}  # sparse
    record = job(tmp_path, attempts=[first, second, "not an attempt"])
    page = render(gather(record), Path(record.log_dir) / "report.html")
    assert "slow: [{&#x27;host&#x27;: &#x27;gpu2&#x27;" in page
    assert "noticed: the node went silent" in page
    assert "<td>2.50</td><td>this node</td>" in page  # a per-node rate the record carries
    assert 'href="rank-0.log"' in page
    old = job(tmp_path / "old")
    assert "written by an older herd" in render(gather(old), Path(old.log_dir) / "r.html")


def test_metrics_given_or_found_from_the_jobs_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "project" / "runs" / "exp"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "loss": 1 / s}) for s in range(1, 5)) + "\n{torn"
    )
    record = job(tmp_path, what="train.py --lr 3 --run-dir runs/exp")
    found = find_metrics(record)
    assert found.path == run / "metrics.jsonl" and "--run-dir runs/exp" in found.found_by
    assert found.series("loss")[-1] == (4.0, 0.25)
    assert find_metrics(record, str(run)).path == run / "metrics.jsonl"
    assert find_metrics(record, str(tmp_path / "nowhere")).path is None
    cloud = find_metrics(job(tmp_path / "c", what="train.py --run_dir=s3://b/runs/x"))
    assert cloud.path is None and "pass --metrics FILE" in cloud.found_by


def test_metrics_written_while_the_job_ran_are_found_without_a_run_dir(tmp_path: Path) -> None:
    record = job(tmp_path, what="train.py")
    project = tmp_path / "project"
    stale = project / "runs" / "old" / "metrics.jsonl"
    fresh = project / "runs" / "minimal" / "metrics.jsonl"
    for path in (stale, fresh):
        path.parent.mkdir(parents=True)
        path.write_text('{"step": 1, "loss": 2.0}\n')
    os.utime(stale, (record.started - 3600, record.started - 3600))  # an earlier job's
    found = find_metrics(record)
    assert found.path == fresh and "while it ran" in found.found_by
    os.utime(fresh, (record.started - 3600, record.started - 3600))
    assert find_metrics(record).path is None


def test_the_page_is_written_beside_the_logs_for_its_owner_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = job(tmp_path)
    page, story = write_report(record)
    assert page == Path(record.log_dir) / "report.html"
    assert page.stat().st_mode & 0o777 == 0o600
    assert story.metrics.path is None
    elsewhere, _ = write_report(record, tmp_path / "out")
    assert elsewhere == tmp_path / "out" / "report.html"
    assert (Path(record.log_dir) / "rank-0.log").as_uri() in elsewhere.read_text()
