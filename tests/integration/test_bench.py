"""`herd bench` on the testbed (3 of its 4 nodes), through the real `herd` command.

Numbers must be plausible, not fast: the testbed's links are veths on a shared machine. A link
slowed with a tc rate limit must be named by `herd bench net` and by `herd doctor`.
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from tests.integration.herd_cli import herd
from tests.testbed import Testbed

# Its fixtures (one `bench all` run) are built once per module: xdist keeps the module on one
# worker. It runs beside other tests: each check compares a link slowed 10x or more with the
# others, which the load of one other test does not blur.
pytestmark = pytest.mark.xdist_group("bench")

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
def bench_all(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One `herd bench all -o DIR` on the healthy testbed: net, allreduce and scaling in one
    run (each command's own code, which the single commands run too); its JSON, its folder,
    its home, and what it printed."""
    tmp = tmp_path_factory.mktemp("all")
    path = testbed.write_cluster_file(tmp / "herd.toml", nodes=list(NODES), connect_timeout=5)
    home, chosen = tmp / "home", tmp / "reports" / "exp1"  # not made yet
    args = ["bench", "all", "-c", str(path), "--max-size", "256K", "--steps", "3"]
    done = herd([*args, "-o", str(chosen)], home, tmp, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((chosen / "bench.json").read_text())
    return {"data": data, "dir": chosen, "home": home, "done": done}


def test_net_measures_every_ordered_pair_in_disjoint_rounds(bench_all: dict[str, Any]) -> None:
    net = bench_all["data"]["net"]
    assert net["hosts"] == NODES
    assert net["rounds"] == 6  # 3 rounds of one pair (a bye each), both directions
    pairs = {(x["src"], x["dst"]) for x in net["links"]}
    assert pairs == {(a, b) for a in NODES for b in NODES if a != b}
    for link in net["links"]:
        assert link["ok"] and link["gbits"] > 0.01 and 0 < link["rtt_ms"] < 100, link
    speeds = sorted(x["gbits"] for x in net["links"])
    assert [x["gbits"] for x in net["slowest"]] == speeds[:3]
    assert net["reference_gbits"] == speeds[0]
    check_png((bench_all["dir"] / "net.png").read_bytes())


def test_allreduce_busbw_is_positive_below_tcp_and_correct(bench_all: dict[str, Any]) -> None:
    result, net = bench_all["data"]["allreduce"], bench_all["data"]["net"]
    assert result["world_size"] == 3 and result["backend"] == "gloo" and result["correct"]
    sizes = [row["size_bytes"] for row in result["rows"]]
    assert sizes == [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10]
    fastest_tcp = max(x["gbits"] for x in net["links"]) / 8  # GB/s
    for row in result["rows"]:
        assert row["correct"]
        assert 0 < row["busbw_gbytes"] < fastest_tcp, (row, fastest_tcp)
        # nccl-tests' definitions, recomputed from the row's own numbers:
        assert row["algbw_gbytes"] == pytest.approx(row["size_bytes"] / row["seconds"] / 1e9)
        assert row["busbw_gbytes"] == pytest.approx(row["algbw_gbytes"] * 2 * 2 / 3)
    assert result["peak_busbw_gbytes"] == max(r["busbw_gbytes"] for r in result["rows"])
    check_png((bench_all["dir"] / "allreduce.png").read_bytes())


def test_scaling_runs_one_to_three_nodes(bench_all: dict[str, Any]) -> None:
    result = bench_all["data"]["scaling"]
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
    check_png((bench_all["dir"] / "scaling.png").read_bytes())


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


def test_all_writes_a_self_contained_report_where_asked(bench_all: dict[str, Any]) -> None:
    done, chosen = bench_all["done"], bench_all["dir"]
    assert "1/3 network" in done.stderr and "3/3 scaling" in done.stderr  # progress
    page = Path(done.stdout.strip().splitlines()[-1].removeprefix("report: "))
    assert page == chosen / "report.html", done.stdout
    assert sorted(p.name for p in chosen.iterdir()) == [
        "allreduce.png",
        "bench.json",
        "net.png",
        "report.html",
        "scaling.png",
    ]
    assert not (bench_all["home"] / "bench").exists()  # nothing went to the default place
    parser = _Page()
    parser.feed(page.read_text())
    parser.close()
    assert parser.tags[:2] == ["html", "head"] and "table" in parser.tags
    assert len(parser.images) == 3
    for src in parser.images:
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)  # embedded: the page needs no other file
        check_png(base64.b64decode(src[len(prefix) :]))
    data = bench_all["data"]
    assert data["hosts"] == NODES and data["id"]
    assert len(data["net"]["links"]) == 6 and data["allreduce"]["correct"]
    assert [p["nodes"] for p in data["scaling"]["points"]] == [1, 2, 3]
    assert "Slowest link" in " ".join(parser.text)


def test_a_slowed_link_is_named_by_bench_net_and_doctor(
    clean_faults: Testbed, three: Path, tmp_path: Path
) -> None:
    clean_faults.rate_limit("node3", 100)
    png = tmp_path / "net.png"
    args = ["bench", "net", "-c", str(three), "--seconds", "0.5", "--png", str(png)]
    result = run_json(args, tmp_path)
    check_png(png.read_bytes())  # the single command draws its own plot where asked
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


def test_allreduce_exits_1_when_a_sum_is_wrong(testbed: Testbed, tmp_path: Path) -> None:
    """Rank 1 really sends a wrong value (the job's own hook, HERD_ALLREDUCE_WRONG_RANK): every
    rank gets a wrong sum back, the check sees it, and the command says so and exits 1."""
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=["node1", "node2"],
        env={"HERD_ALLREDUCE_WRONG_RANK": "1"},
    )
    args = ["bench", "allreduce", "-c", str(path), "--max-size", "4K", "--iters", "3"]
    done = herd(args, tmp_path / "home", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the all-reduce returned wrong sums" in done.stdout, done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert rows and all(row[-1] == "NO" for row in rows), done.stdout
    assert "Traceback" not in done.stderr
    # Without the hook the same code finds every sum right (bench_all's all-reduce).


def test_scaling_comm_wait_is_high_across_a_slow_link(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    """node2's link limited to 2 Mbit/s (tc): with two nodes most of a step waits on the
    gradient all-reduce (0.8 MB, three seconds on that link, against some 20 ms of compute, or
    up to a second on a machine running three testbeds); one node has nobody to wait for."""
    clean_faults.rate_limit("node2", 2)
    path = clean_faults.write_cluster_file(
        tmp_path / "herd.toml", nodes=["node1", "node2"], connect_timeout=5
    )
    args = ["bench", "scaling", "-c", str(path), "--steps", "5", "--batch", "2048"]
    result = run_json([*args, "--width", "256"], tmp_path)
    one, two = result["points"]
    assert (one["nodes"], two["nodes"]) == (1, 2)
    assert two["comm_share"] > 0.6, two
    # The share's time: waiting on 2 nodes dwarfs what one node shows, which on a busy
    # machine is the scheduler's noise (tens of ms a step) rather than communication.
    waited = [p["seconds"] * p["comm_share"] for p in (one, two)]
    assert waited[1] > 5 * waited[0], (one, two)


@pytest.fixture(scope="module")
def python_without_matplotlib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with everything this suite's interpreter has except matplotlib (the bench
    extra): each of its site-packages entries linked in, matplotlib's left out."""
    import matplotlib

    packages = Path(matplotlib.__file__).parents[1]
    root = tmp_path_factory.mktemp("no-matplotlib") / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60
    )
    target = next(root.glob("lib/python3*/site-packages"))
    for entry in packages.iterdir():
        if not entry.name.startswith(("matplotlib", "mpl_toolkits", "pylab")):
            (target / entry.name).symlink_to(entry)
    python = root / "bin" / "python"
    probe = "import importlib.util as u; print(u.find_spec('matplotlib'), u.find_spec('torchherd'))"
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    words = found.stdout.split()
    assert words[0] == "None" and words[1] != "None", found.stdout + found.stderr
    return python


@pytest.mark.parametrize("command", ["net", "allreduce", "scaling"])
def test_png_without_matplotlib_is_an_error_before_measuring(
    python_without_matplotlib: Path, three: Path, tmp_path: Path, command: str
) -> None:
    home, png = tmp_path / "home", tmp_path / "plot.png"
    args = ["bench", command, "-c", str(three), "--png", str(png)]
    done = herd(args, home, tmp_path, python=python_without_matplotlib)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: drawing the plots needs matplotlib" in done.stderr, done.stderr
    assert "pip install 'torchherd[bench]'" in done.stderr
    assert "Traceback" not in done.stderr
    # Refused before anything ran: no job was started on the nodes, nothing was printed.
    assert not (home / "jobs").exists() and done.stdout == "" and not png.exists()
