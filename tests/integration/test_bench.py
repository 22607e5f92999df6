"""`herd bench` on the testbed (3 of its 4 nodes), through the real `herd` command.

Numbers must be plausible, not fast: the testbed's links are veths on a shared machine. A link
slowed with a tc rate limit must be named by `herd bench net` and by `herd doctor`.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from tests.integration.herd_cli import herd
from tests.testbed import Testbed

NODES = ["node1", "node2", "node3"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_png(data: bytes) -> tuple[int, int]:
    """A PNG that really decodes: signature, IHDR with a size, and every chunk's CRC; then
    matplotlib (the extra that drew it) reads the pixels back."""
    assert data[:8] == PNG_SIGNATURE, data[:16]
    offset, chunks = 8, []
    while offset < len(data):
        (length,) = struct.unpack("!I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack("!I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.append(kind)
        offset += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks
    width, height = struct.unpack("!II", data[16:24])
    assert width > 100 and height > 100
    import io

    from matplotlib import image

    pixels = image.imread(io.BytesIO(data), format="png")
    assert pixels.shape[:2] == (height, width)
    return width, height


def run_json(args: list[str], tmp_path: Path, timeout: float = 400) -> dict[str, Any]:
    done = herd([*args, "--json"], tmp_path / "home", tmp_path, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def three(testbed: Testbed, tmp_path: Path) -> Path:
    return testbed.write_cluster_file(tmp_path / "herd.toml", nodes=list(NODES), connect_timeout=5)


@pytest.fixture(scope="module")
def net(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One `herd bench net` on the healthy testbed, its JSON and its PNG checked."""
    tmp = tmp_path_factory.mktemp("net")
    path = testbed.write_cluster_file(tmp / "herd.toml", nodes=list(NODES), connect_timeout=5)
    png = tmp / "net.png"
    result = run_json(["bench", "net", "-c", str(path), "--seconds", "0.5", "--png", str(png)], tmp)
    result["png"] = png.read_bytes()
    return result


def test_net_measures_every_ordered_pair_in_disjoint_rounds(net: dict[str, Any]) -> None:
    assert net["hosts"] == NODES
    assert net["rounds"] == 6  # 3 rounds of one pair (a bye each), both directions
    pairs = {(x["src"], x["dst"]) for x in net["links"]}
    assert pairs == {(a, b) for a in NODES for b in NODES if a != b}
    for link in net["links"]:
        assert link["ok"] and link["gbits"] > 0.01 and 0 < link["rtt_ms"] < 100, link
    speeds = sorted(x["gbits"] for x in net["links"])
    assert [x["gbits"] for x in net["slowest"]] == speeds[:3]
    assert net["reference_gbits"] == speeds[0]
    check_png(net["png"])


def test_allreduce_busbw_is_positive_below_tcp_and_correct(
    net: dict[str, Any], three: Path, tmp_path: Path
) -> None:
    png = tmp_path / "allreduce.png"
    args = ["bench", "allreduce", "-c", str(three), "--max-size", "1M", "--seconds", "0.2"]
    result = run_json([*args, "--png", str(png), "--link-gbits", "5"], tmp_path)
    assert result["world_size"] == 3 and result["backend"] == "gloo" and result["correct"]
    sizes = [row["size_bytes"] for row in result["rows"]]
    assert sizes == [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
    fastest_tcp = max(x["gbits"] for x in net["links"]) / 8  # GB/s
    for row in result["rows"]:
        assert row["correct"]
        assert 0 < row["busbw_gbytes"] < fastest_tcp, (row, fastest_tcp)
        # nccl-tests' definitions, recomputed from the row's own numbers:
        assert row["algbw_gbytes"] == pytest.approx(row["size_bytes"] / row["seconds"] / 1e9)
        assert row["busbw_gbytes"] == pytest.approx(row["algbw_gbytes"] * 2 * 2 / 3)
    assert result["peak_busbw_gbytes"] == max(r["busbw_gbytes"] for r in result["rows"])
    check_png(png.read_bytes())


def test_scaling_runs_one_to_three_nodes(three: Path, tmp_path: Path) -> None:
    png = tmp_path / "scaling.png"
    args = ["bench", "scaling", "-c", str(three), "--steps", "3", "--width", "256"]
    result = run_json([*args, "--png", str(png)], tmp_path)
    assert result["unit"] == "samples/s" and "reference MLP" in result["workload"]
    points = result["points"]
    assert [p["nodes"] for p in points] == [1, 2, 3]
    assert [p["world_size"] for p in points] == [1, 2, 3]
    assert points[0]["efficiency"] == pytest.approx(1.0)
    for p in points:
        assert p["throughput"] > 0 and p["seconds"] > 0
        assert p["efficiency"] == pytest.approx(
            p["throughput"] / (p["nodes"] * points[0]["throughput"])
        )
        assert 0.0 <= p["comm_share"] <= 1.0
    check_png(png.read_bytes())


def test_scaling_runs_your_script_with_its_arguments(three: Path, tmp_path: Path) -> None:
    # The script fails unless it gets the arguments given after `--`.
    (tmp_path / "work.py").write_text(
        "import sys, time\nsys.exit(0 if sys.argv[1:] == ['--flag', 'x'] else 3)\n"
    )
    args = ["bench", "scaling", "-c", str(three), "--max-nodes", "2", "--script", "work.py"]
    done = herd([*args, "--json", "--", "--flag", "x"], tmp_path / "home", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["unit"] == "node-runs/h" and result["workload"] == "script work.py"
    points = result["points"]
    assert [p["nodes"] for p in points] == [1, 2]
    assert all(p["comm_share"] is None and p["seconds"] > 0 for p in points)
    assert points[1]["throughput"] == pytest.approx(2 * 3600 / points[1]["seconds"])
    failing = herd([*args, "--", "--other"], tmp_path / "home", tmp_path)
    assert failing.returncode == 1 and "the script failed on 1 node(s)" in failing.stderr


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.images: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag == "img":
            self.images.append(dict(attrs)["src"] or "")

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def test_all_writes_a_self_contained_report(three: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    args = ["bench", "all", "-c", str(three), "--max-size", "256K", "--steps", "3"]
    done = herd(args, home, tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1/3 network" in done.stderr and "3/3 scaling" in done.stderr  # progress
    page = Path(done.stdout.strip().splitlines()[-1].removeprefix("report: "))
    assert page.parent.parent == home / "bench" and page.name == "report.html"
    parser = _Page()
    parser.feed(page.read_text())
    parser.close()
    assert parser.tags[:2] == ["html", "head"] and "table" in parser.tags
    assert len(parser.images) == 3
    for src in parser.images:
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)  # embedded: the page needs no other file
        check_png(base64.b64decode(src[len(prefix) :]))
    data = json.loads((page.parent / "bench.json").read_text())
    assert data["hosts"] == NODES and data["id"] == page.parent.name
    assert len(data["net"]["links"]) == 6 and data["allreduce"]["correct"]
    assert [p["nodes"] for p in data["scaling"]["points"]] == [1, 2, 3]
    assert "Slowest link" in " ".join(parser.text)


def test_a_slowed_link_is_named_by_bench_net_and_doctor(
    clean_faults: Testbed, three: Path, tmp_path: Path
) -> None:
    clean_faults.rate_limit("node3", 100)
    result = run_json(["bench", "net", "-c", str(three), "--seconds", "0.5"], tmp_path)
    assert result["slow_node"] == "node3", result["links"]
    assert "node3" in (result["slowest"][0]["src"], result["slowest"][0]["dst"])
    assert result["slowest"][0]["gbits"] < 0.2  # 100 Mbit/s, give or take
    done = herd(["doctor", "-c", str(three), "--json"], tmp_path / "home", tmp_path)
    report = json.loads(done.stdout)
    slowest = report["slowest_link"]
    assert "node3" in (slowest["src"], slowest["dst"]) and slowest["gbits"] < 0.2, slowest
    assert report["slow_node"] == "node3"
    speed = {r["host"]: r for r in report["results"] if r["check"] == "network"}
    assert speed["node3"]["status"] == "warn" and "node3" in speed["node3"]["summary"]
    text = herd(["doctor", "-c", str(three)], tmp_path / "home", tmp_path).stdout
    assert "the slow links all touch node3" in text
