"""`herd bench` without a cluster: the arithmetic (busbw, efficiency, communication share),
sizes, the JSON forms, the HTML page, and the errors for bad input or a missing extra."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from torchherd.bench.allreduce import AllreduceOptions, AllreduceResult
from torchherd.bench.job import JobAnswer, read_answer
from torchherd.bench.net import NetMatrix
from torchherd.bench.plots import PlotsUnavailable, net_heatmap
from torchherd.bench.report import BenchReport, render_html, write_report
from torchherd.bench.scaling import (
    ScalingPoint,
    ScalingResult,
    comm_share,
    efficiency,
    node_counts,
)
from torchherd.cli import main
from torchherd.cli.bench import parse_size
from torchherd.errors import UsageError
from torchherd.preflight.report import BusBandwidth, Link, bus_bandwidth, sizes_between
from torchherd.results import RunResult

HOSTS = ("a", "b", "c")


def test_bus_bandwidth_is_nccl_tests_definition() -> None:
    assert bus_bandwidth(10.0, 1) == 0.0  # one rank moves nothing over a link
    assert bus_bandwidth(10.0, 2) == pytest.approx(10.0)
    assert bus_bandwidth(10.0, 4) == pytest.approx(15.0)
    assert bus_bandwidth(3.0, 3) == pytest.approx(4.0)
    assert bus_bandwidth(1.0, 1000) == pytest.approx(1.998)
    with pytest.raises(ValueError):
        bus_bandwidth(1.0, 0)


def test_efficiency_and_communication_share() -> None:
    assert efficiency(100.0, 1, 100.0) == 1.0
    assert efficiency(180.0, 2, 100.0) == pytest.approx(0.9)
    assert efficiency(200.0, 4, 100.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        efficiency(1.0, 0, 1.0)
    assert comm_share(2.0, 1.5) == pytest.approx(0.25)
    assert comm_share(1.0, 1.2) == 0.0  # noise: compute alone measured slower
    assert comm_share(0.0, 0.0) == 0.0


def test_node_counts_double_then_end_at_the_total() -> None:
    assert node_counts(1) == [1]
    assert node_counts(3) == [1, 2, 3]
    assert node_counts(4) == [1, 2, 4]
    assert node_counts(10) == [1, 2, 4, 8, 10]


def test_sizes_like_nccl_tests_and_sizes_on_the_command_line() -> None:
    assert sizes_between(1024, 1 << 20, 4) == [
        1 << 10,
        4 << 10,
        16 << 10,
        64 << 10,
        256 << 10,
        1 << 20,
    ]
    assert sizes_between(1024, 3000, 2) == [1024, 2048, 3000]
    assert sizes_between(64, 64, 2) == [64]
    with pytest.raises(ValueError):
        sizes_between(2048, 1024, 2)
    assert parse_size("1K", "--x") == 1024 and parse_size("64MiB", "--x") == 64 << 20
    assert parse_size("4mb", "--x") == 4 << 20 and parse_size("123", "--x") == 123
    with pytest.raises(UsageError, match="--max-size"):
        parse_size("lots", "--max-size")


def test_bad_sizes_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "allreduce", "--max-size", "1X"]) == 2
    assert "--max-size: cannot read '1X'" in capsys.readouterr().err
    assert main(["bench", "allreduce", "--min-size", "2M", "--max-size", "1M"]) == 2
    err = capsys.readouterr().err
    assert "bad size range" in err and "fix:" in err and "Traceback" not in err


def test_net_needs_a_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # no herd.toml: this machine alone
    assert main(["bench", "net"]) == 2
    assert "at least 2 nodes" in capsys.readouterr().err


def link(src: str, dst: str, gbits: float) -> Link:
    return Link(src, dst, "10.0.0.1", 1, "ephemeral", True, rtt_ms=0.1, gbits=gbits)


def matrix(slow: str | None = None) -> NetMatrix:
    links = tuple(
        link(a, b, 0.1 if slow in (a, b) else 10.0 + len(a + b))
        for a in HOSTS
        for b in HOSTS
        if a != b
    )
    return NetMatrix(hosts=HOSTS, links=links, rounds=6, seconds=3.0)


def test_net_matrix_json_names_slowest_links_and_their_node() -> None:
    data = json.loads(json.dumps(matrix("c").to_dict()))
    assert set(data) >= {"hosts", "rounds", "links", "slowest", "slow_node", "reference_gbits"}
    assert data["hosts"] == list(HOSTS) and len(data["links"]) == 6
    assert data["slow_node"] == "c" and data["reference_gbits"] == 0.1
    assert all("c" in (x["src"], x["dst"]) for x in data["slowest"])
    assert matrix().to_dict()["slow_node"] is None


def allreduce_result() -> AllreduceResult:
    rows = tuple(
        BusBandwidth(size, size / 1e9, 1.0 * k, bus_bandwidth(1.0 * k, 3))
        for k, size in enumerate((1024, 4096, 16384), start=1)
    )
    return AllreduceResult(HOSTS, 3, "gloo", True, rows, 12.0)


def scaling_result() -> ScalingResult:
    points = (
        ScalingPoint(1, 1, 1.0, 100.0, 1.0, 0.0),
        ScalingPoint(2, 2, 1.1, 180.0, 0.9, 0.1),
    )
    return ScalingResult("reference MLP", "samples/s", points)


def test_results_read_back_from_the_job_output() -> None:
    row = {"size_bytes": 1024, "seconds": 0.001, "algbw_gbytes": 0.001, "busbw_gbytes": 0.002}
    text = "node1:0 | noise\nnode1:0 | HERD_ALLREDUCE " + json.dumps({"rows": [row]}) + "\n"
    answer = read_answer(text, "HERD_ALLREDUCE ")
    assert answer is not None and BusBandwidth.from_dict(answer["rows"][0]).correct
    assert read_answer("HERD_ALLREDUCE {broken", "HERD_ALLREDUCE ") is None
    silent = JobAnswer(RunResult("j", 0), None, "")
    assert not silent.ok and silent.why_not()[0] == "the job printed no result"
    data = allreduce_result().to_dict()
    assert data["peak_busbw_gbytes"] == pytest.approx(bus_bandwidth(3.0, 3))
    assert [r["size_bytes"] for r in data["rows"]] == [1024, 4096, 16384]
    assert AllreduceOptions(max_size=4096, factor=2).sizes() == [1024, 2048, 4096]


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake absence: None in sys.modules makes `import matplotlib` raise ImportError, as on
    # a machine without the extra.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotsUnavailable) as caught:
        net_heatmap(matrix())
    assert "pip install 'torchherd[bench]'" in caught.value.remedy
    report = BenchReport("r1", HOSTS, 0.0, net=matrix())
    report.draw()
    assert report.plots == {} and "torchherd[bench]" in report.plots_missing
    assert "torchherd[bench]" in render_html(report)  # the page says how to get the plots


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.images.append(dict(attrs)["src"] or "")


def test_report_page_embeds_every_plot_and_json_round_trips(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib", reason="the torchherd[bench] extra draws the plots")
    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))
    report = BenchReport(
        "r2", HOSTS, 0.0, net=matrix("b"), allreduce=allreduce_result(), scaling=scaling_result()
    )
    report.draw()
    assert set(report.plots) == {"net", "allreduce", "scaling"}
    page = write_report(report)
    assert page == tmp_path / "home" / "bench" / "r2" / "report.html"
    parser = _Images()
    parser.feed(page.read_text())
    assert len(parser.images) == 3
    for src in parser.images:
        png = base64.b64decode(src.removeprefix("data:image/png;base64,"))
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    data = json.loads((page.parent / "bench.json").read_text())
    assert data["id"] == "r2" and data["net"]["slow_node"] == "b"
    assert data["scaling"]["points"][1]["efficiency"] == 0.9
    assert (page.parent / "net.png").read_bytes() == report.plots["net"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["bench", "net"], "needs a cluster of at least 2 nodes"),
        (["bench", "allreduce", "--min-size", "1M", "--max-size", "1K"], "--min-size"),
        (["bench", "allreduce", "--png", "out.png"], "torchherd[bench]"),
    ],
)
def test_bench_refuses_before_it_imports_torch(argv: list[str], said: str, tmp_path: Path) -> None:
    """A refusal of `herd bench` comes before torch is imported (seconds of start-up); here
    without matplotlib (an import of it fails, as where the extra is not installed)."""
    as_herd = (
        "import sys; sys.modules['matplotlib'] = None; from torchherd.cli import main; "
        f"code = main({argv!r}); print('torch imported:', 'torch' in sys.modules); "
        "sys.exit(code)"
    )
    run = subprocess.run(
        [sys.executable, "-c", as_herd],
        cwd=tmp_path,
        env=dict(os.environ, HERD_HOME=str(tmp_path / "home")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert said in run.stderr, run.stderr
    assert "torch imported: False" in run.stdout, run.stdout
