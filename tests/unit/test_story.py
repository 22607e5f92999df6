"""The report page's reading of a job: tolerant of old and newer records, and finding the
metrics the script wrote (given, from the job's --run-dir, or written under its workdir
while it ran). The page itself is looked at in a browser in tests/integration."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from torchherd.records import JobRecord, attempt_entry
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
    # In words, never as Python's repr: a list's items one after the other.
    assert "slow: host gpu2, rank 3, step_time 1.9<" in page
    assert "[" not in page.split("slow: ", 1)[1].split("<", 1)[0]
    named = attempt_entry(2, [{"host": "gpu1", "nproc": 2}], 4, None)
    named["slow"] = ["gpu2 rank 3 is 1.3x slower", "gpu1 rank 0 is 1.2x slower"]
    shown = render(gather(job(tmp_path / "n", attempts=[named])), Path(record.log_dir) / "r.html")
    assert "slow: gpu2 rank 3 is 1.3x slower; gpu1 rank 0 is 1.2x slower<" in shown
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


def write_records(path: Path, records: list[dict[str, object]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_job_started_soon_after_in_the_same_folder_does_not_lend_its_curves(
    tmp_path: Path,
) -> None:
    record = job(tmp_path, what="train.py")
    assert record.ended is not None
    later = write_records(
        tmp_path / "project" / "runs" / "next" / "metrics.jsonl", [{"step": 1, "loss": 9.0}]
    )
    os.utime(later, (record.ended + 60, record.ended + 60))  # written by the next job
    found = find_metrics(record)
    assert found.path is None and "written while the job ran" in found.found_by
    # stamped records say it even more plainly: the later job's times are outside the window
    write_records(later, [{"step": 1, "loss": 9.0, "time": record.ended + 60}])
    os.utime(later, (record.ended + 60, record.ended + 60))
    assert find_metrics(record).path is None


def test_two_files_written_while_the_job_ran_are_named_not_guessed_between(
    tmp_path: Path,
) -> None:
    record = job(tmp_path, what="train.py")
    now = time.time() - 50
    for name in ("a", "b"):
        write_records(
            tmp_path / "project" / "runs" / name / "metrics.jsonl",
            [{"step": 1, "loss": 1.0, "time": now}],
        )
    found = find_metrics(record)
    assert found.path is None
    assert "2 metrics.jsonl files" in found.found_by and "--metrics PATH" in found.found_by


def test_only_the_jobs_own_records_of_a_shared_run_directory_are_drawn(tmp_path: Path) -> None:
    record = job(tmp_path, what="train.py --run-dir runs/exp")
    assert record.ended is not None
    earlier = [{"step": s, "loss": 5.0, "time": record.started - 900} for s in range(1, 4)]
    own = [{"step": s, "loss": 1.0 / s, "time": record.started + s} for s in range(4, 8)]
    later = [{"step": s, "loss": 7.0, "time": record.ended + 300} for s in range(8, 10)]
    write_records(tmp_path / "project" / "runs" / "exp" / "metrics.jsonl", earlier + own + later)
    found = find_metrics(record)
    assert [step for step, _ in found.series("loss")] == [4.0, 5.0, 6.0, 7.0]
    assert "5 record(s) written by other runs" in found.found_by
    # a run directory whose every record is another job's gives no curves at all
    other = job(tmp_path / "o", what="train.py --run-dir runs/exp")
    write_records(tmp_path / "o" / "project" / "runs" / "exp" / "metrics.jsonl", later)
    assert find_metrics(other).path is None


def test_the_page_names_the_metrics_file_once(tmp_path: Path) -> None:
    record = job(tmp_path, what="train.py")
    path = write_records(
        tmp_path / "project" / "runs" / "m" / "metrics.jsonl",
        [{"step": s, "loss": 1.0 / s} for s in range(1, 5)],
    )
    page = render(gather(record), Path(record.log_dir) / "report.html")
    assert page.count(str(path)) == 1


def test_the_first_failure_keeps_its_stderr_tail_on_the_page(tmp_path: Path) -> None:
    from torchherd.launcher.job import failure_record
    from torchherd.results import Failure, RunResult

    tail = (
        "[W1124 16:45:07.299359013 socket.cpp:207] [c10d] The hostname of the client socket "
        "cannot be retrieved. err=-3",
        "[rank3]: Traceback (most recent call last):",
        '[rank3]:   File "train.py", line 9',
        "[rank3]: ValueError: bad value 42",
    )
    failure = Failure(host="gpu2", rank=3, exitcode=1, signal=None, message="", last_stderr=tail)
    kept = failure_record(RunResult(job_id="j", exit_code=1, first_failure=failure), [])
    assert kept is not None and kept["stderr_tail"] == list(tail)
    record = job(tmp_path, first_failure=kept)
    page = render(gather(record), Path(record.log_dir) / "report.html")
    assert "First failure: gpu2 rank 3: exit code 1: ValueError: bad value 42" in page
    assert "<td>ValueError: bad value 42</td>" in page  # the message row, not "-"
    assert "File &quot;train.py&quot;, line 9" in page  # the tail itself
    assert "hostname of the client socket" not in page  # torch's chatter is not the error
    assert "[rank3]" not in page  # the rank is named once, not on every line


def test_loss_is_drawn_on_a_log_axis_with_round_ticks_and_a_labelled_step_axis() -> None:
    from torchherd.story.svg import line_chart

    points = [(float(s), 10.0 / s**1.5) for s in range(1, 301)]
    chart = line_chart(points, "loss", log=True)
    assert "loss (log scale)" in chart
    labels = re.findall(r">([^<>]+)</text>", chart)
    assert {"0.01", "0.1", "1", "10"} <= set(labels), labels
    assert "step" in labels
    assert {"100", "200", "300"} <= set(labels), labels  # round steps between first and last
    linear = line_chart([(1.0, -1.0), (2.0, 3.0)], "value", log=True)  # not all above zero
    assert "log scale" not in linear and "-1" in re.findall(r">([^<>]+)</text>", linear)


def test_start_phases_and_each_nodes_step_times_are_shown_where_the_record_has_them(
    tmp_path: Path,
) -> None:
    first = attempt_entry(0, [{"host": "gpu1", "nproc": 2}], 2, None)
    first["phases"] = {"connect": 0.5, "probe": 1.0, "rendezvous": 2.5}
    first["phases_slowest"] = {"probe": "gpu2"}
    first["nodes"] = [
        {"host": "gpu1", "nproc": 2},
        {"host": "gpu2", "nproc": 2, "phases": {"probe": 0.9}},
    ]
    record = job(tmp_path, attempts=[first])
    page = render(gather(record), Path(record.log_dir) / "report.html")
    assert "<h2>Start of each attempt</h2>" in page
    assert "<td>rendezvous</td><td>2.50</td><td>62 %</td>" in page
    assert "<td>total (to the first step)</td><td>4.00</td><td>100 %</td>" in page
    assert "<td>probe</td><td>1.00</td><td>25 %</td><td>gpu2 (0.90 s)</td>" in page
    assert "phases:" not in page  # not listed again among the keys a newer herd adds
    plain = job(tmp_path / "plain", attempts=[attempt_entry(0, [{"host": "gpu1"}], 1, None)])
    shown = render(gather(plain), Path(plain.log_dir) / "report.html")
    assert "Start of each attempt" not in shown and "Step time per node" not in shown


def strip_heights(page: str) -> dict[str, list[float]]:
    """host -> how far below its strip's top each point lies (SVG y grows downwards)."""
    tops = [float(y) for y in re.findall(r'<rect x="110" y="([\d.]+)"[^>]*fill="#f4f4f4"', page)]
    found = re.findall(r'<polyline points="([^"]+)"[^>]*data-host="([^"]+)"', page)
    return {
        host: [float(p.split(",")[1]) - top for p in pts.split()]
        for (pts, host), top in zip(found, tops, strict=True)
    }


def test_each_nodes_step_time_is_a_strip_on_one_axis_and_the_slow_one_sits_higher(
    tmp_path: Path,
) -> None:
    """Two attempts of two nodes; gpu2 slows in the second and is named there: its strip is
    higher than gpu1's from then on (one scale for all), and the mark sits where it was
    named, on the job's time axis (which the timeline shares)."""
    record = job(tmp_path)
    t0 = record.started
    first = attempt_entry(0, [{"host": "gpu1"}, {"host": "gpu2"}], 2, None)
    second = attempt_entry(1, [{"host": "gpu1"}, {"host": "gpu2"}], 2, None)
    first.update(started=t0, ended=t0 + 100, outcome="failed")
    second.update(started=t0 + 110, ended=t0 + 200, outcome="interrupted")
    for i, host in enumerate(("gpu1", "gpu2")):
        first["nodes"][i]["step_times"] = [[s, 0.1, t0 + s] for s in range(10, 100, 10)]
        slow = 0.1 if host == "gpu1" else 0.13
        second["nodes"][i]["step_times"] = [[s, slow, t0 + 20 + s] for s in range(100, 180, 10)]
        second["nodes"][i]["step_times_measure"] = "work"
    second["nodes"][1]["named_slow_at"] = t0 + 150
    record.attempts = [first, second]
    record.ended = t0 + 200
    page = render(gather(record), Path(record.log_dir) / "report.html")
    assert '<h2 id="step-times">Step time per node</h2>' in page
    heights = strip_heights(page)
    assert set(heights) == {"gpu1", "gpu2"} and len(heights["gpu2"]) == 17
    gpu1, gpu2 = heights["gpu1"], heights["gpu2"]
    assert gpu2[:9] == gpu1[:9] and len(set(gpu1)) == 1  # one scale: the same time, the same
    assert max(gpu2[9:]) < gpu1[0] - 3  # gpu2 slowed: higher in its strip from then on
    last_x = float(re.findall(r'<polyline points="[^"]* ([\d.]+),[\d.]+"', page)[-1])
    assert abs(last_x - (110 + 770 * 190 / 200)) < 1  # gpu2's last point: 190 s in
    mark = re.search(r'<line x1="([\d.]+)"[^>]*class="named-slow"><title>gpu2 named', page)
    assert mark is not None, page
    # 150 s into a 200 s job, on the timeline's axis, from x=110 to x=880.
    assert abs(float(mark.group(1)) - (110 + 770 * 150 / 200)) < 1
    assert re.findall(r">(\d+ ms)</text>", page) == ["100 ms", "130 ms"]  # each one's latest
    assert "the step less the time it waited for the others" in page
    assert "step_times" not in page  # not listed among the attempt's unknown keys


def test_replica_groups_show_each_outage_on_the_time_axis_and_in_words(tmp_path: Path) -> None:
    record = job(tmp_path)
    start = record.started
    record.ended = start + 100
    record.groups = [
        {"group": 0, "host": "gpu1", "runs": 1, "exit_code": 0, "outages": []},
        {
            "group": 1,
            "host": "gpu4",
            "hosts": ["gpu2", "gpu4"],
            "runs": 2,
            "exit_code": 0,
            "outages": [
                {"down_at": start + 50, "steps_before": 89, "next_commit_s": 3.04, "healed_s": 5.8}
            ],
        },
        {"group": 2, "host": "gpu3", "runs": 1, "exit_code": None,
         "outages": [{"down_at": start + 80, "next_commit_s": None, "healed_s": None}]},
    ]  # fmt: skip
    page = render(gather(record), Path(record.log_dir) / "report.html")
    assert "<h2>Replica groups</h2>" in page
    said = "down 50 s in at step 89; the others&#x27; next commit 3.0 s later; healed 5.8 s later"
    assert said in page
    assert "never came back" in page
    assert "<td>1</td><td>gpu2 → gpu4</td>" in page  # a spare took gpu2's place
    # On a 900-wide axis with 110 on the left and 20 on the right, 100 s span 770 units:
    # group 1 is out from 50 s for 5.8 s, group 2 from 80 s to the end.
    outages = re.findall(r'<rect class="outage" x="([\d.]+)" y="\d+" width="([\d.]+)"', page)
    assert [(float(x), float(w)) for x, w in outages] == [
        (pytest.approx(110 + 385, abs=0.2), pytest.approx(5.8 * 7.7, abs=0.2)),
        (pytest.approx(110 + 616, abs=0.2), pytest.approx(20 * 7.7, abs=0.2)),
    ]
    assert "Replica groups" not in render(gather(job(tmp_path / "plain")), tmp_path / "r.html")


def test_the_facts_name_a_large_jobs_nodes_as_hostlists(tmp_path: Path) -> None:
    """The nodes row of a job on many nodes is one hostlist per worker count, as the banner
    says it, not a thousand `host×nproc` entries; a small job's nodes each by name."""
    record = job(tmp_path)
    record.nodes = [{"host": f"sim{i}", "nproc": 8} for i in range(1000)]
    record.nodes[3]["nproc"] = 4
    page = render(gather(record), Path(record.log_dir) / "report.html")
    assert "<td>sim[0-2,4-999]×8, sim3×4</td>" in page
    small = job(tmp_path / "small")
    assert "<td>gpu1×2, gpu2×2</td>" in render(gather(small), Path(small.log_dir) / "r.html")
