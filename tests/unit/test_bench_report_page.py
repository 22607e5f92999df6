"""`herd bench all` as a newcomer meets it: on one machine it runs what can run there and
still writes the report; the page opens with a verdict and says what it ran on; a plot that
cannot be drawn is refused before minutes of measuring, not after."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.integration.herd_cli import herd
from tests.unit.test_bench import HOSTS, allreduce_result, matrix, scaling_result
from torchherd.bench.report import BenchReport, render_html
from torchherd.bench.scaling import ScalingPoint, ScalingResult
from torchherd.bench.verdict import judge, overall
from torchherd.cli import main


def test_the_verdict_names_the_worst_part() -> None:
    report = BenchReport(
        "r", HOSTS, 0.0, net=matrix("c"), allreduce=allreduce_result(), scaling=scaling_result()
    )
    findings = {f.part: f for f in report.findings()}
    assert findings["network"].status == "warn"
    assert "the slow links all touch c" in findings["network"].text
    assert findings["scaling"].status == "ok" and "90% efficiency on 2 nodes" in (
        findings["scaling"].text
    )
    assert overall(report.findings()) == ("warn", "warning in network: see below")
    poor = ScalingResult("MLP", "samples/s", (ScalingPoint(4, 4, 1.0, 100.0, 0.5, 0.4),))
    assert judge(None, None, poor)[2].status == "bad"
    alone = judge(None, None, None, {"net": "it needs at least 2 nodes reached over ssh"})
    assert alone[0].status == "skipped" and "at least 2 nodes" in alone[0].text


def test_the_page_opens_with_the_verdict_and_says_what_it_ran_on() -> None:
    report = BenchReport(
        "r3",
        HOSTS,
        time.time(),
        net=matrix(),
        allreduce=allreduce_result(),
        scaling=scaling_result(),
    )
    report.command = "herd bench all -H a,b,c"
    report.machines = [
        {
            "host": h,
            "cpus": 64,
            "gpus": 8,
            "python": "3.11.2",
            "torch": "2.13.0",
            "torchherd": "0.1.0",
        }
        for h in HOSTS
    ]
    page = render_html(report)
    assert page.index("Verdict:") < page.index("<h2>Network")
    assert "herd bench all -H a,b,c" in page
    assert "<th>CPU cores</th><th>GPUs</th><th>python</th><th>torch</th>" in page
    assert "2.13.0" in page
    assert "time (µs)" in page and "time us" not in page
    data = report.to_dict()
    assert data["verdict"]["status"] in ("ok", "warn", "bad")
    assert data["command"] == "herd bench all -H a,b,c" and len(data["machines"]) == 3


def test_png_without_matplotlib_is_refused_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules makes `import matplotlib` fail as on a machine without the extra.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    code = main(["bench", "allreduce", "--png", str(tmp_path / "ar.png")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "pip install 'torchherd[bench]'" in err
    assert time.monotonic() - started < 5  # no job was started (one takes many seconds)


def test_bench_all_on_one_machine_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    run = herd(
        [
            "bench",
            "all",
            "--nproc",
            "2",
            "--max-size",
            "4K",
            "--steps",
            "1",
            "-o",
            str(out),
        ],
        tmp_path / "home",
        tmp_path,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "network: skipped" in run.stdout
    data = json.loads((out / "bench.json").read_text())
    assert data["net"] is None and data["allreduce"]["correct"]
    assert data["scaling"]["points"][0]["nodes"] == 1
    assert data["machines"][0]["host"] == "localhost"
    page = (out / "report.html").read_text()
    assert "Verdict:" in page and "needs at least 2 nodes" in page
    # herd's own measuring jobs stay out of `herd ps`
    listed = herd(["ps"], tmp_path / "home", tmp_path, timeout=60)
    assert "no jobs yet" in listed.stdout
