"""`herd report JOB` after real jobs (one with a restart, one that failed, `herd demo`), looked
at in a real browser.

Two testbed nodes; the worker on node2 kills itself (SIGKILL) in the first attempt once the
snapshot at step 40 exists; herd takes node1's stacks, restarts the job, the Trainer resumes and
finishes. The page herd writes is loaded in headless Chromium (Debian's package), its DOM dumped
and a screenshot taken: a reader must see how the job ended, the two attempts on the timeline
(the failed one red, the restart green), how herd noticed the fault, the first failure, the step
rate per node, the loss curve, and links to every rank's log and the stacks that lead to files.
A failed job's page shows the error its rank raised and that rank's last stderr lines; the
demo's page shows its curves. With HERD_REPORT_SHOTS=DIR the screenshots are copied there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from tests.integration.herd_cli import SCRIPTS
from tests.testbed import Testbed

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("chromium is not installed (bash scripts/test installs Debian's package)")
    return found


def browse(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()],
        capture_output=True,
        text=True,
        timeout=180,
    )


class Page(HTMLParser):
    """The text a reader sees and the links, from Chromium's DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.links: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("style", "script"):
            self._skip += 1
        if tag == "a":
            self.links.append(dict(attrs).get("href") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("style", "script"):
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip and data.strip():
            self.text.append(" ".join(data.split()))


def pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """Width, height and the RGB(A) rows of an 8-bit PNG (what Chromium writes)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    offset, idat, width = 8, b"", 0
    height = depth = colour = 0
    while offset < len(png):
        (length,) = struct.unpack(">I", png[offset : offset + 4])
        kind = png[offset + 4 : offset + 8]
        data = png[offset + 8 : offset + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", data[:10])
        elif kind == b"IDAT":
            idat += data
        offset += 12 + length
    assert depth == 8 and colour in (2, 6), (depth, colour)
    step = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * step
    rows, previous = [], bytearray(stride)
    for y in range(height):
        kind, line = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        for i in range(stride):
            left = line[i - step] if i >= step else 0
            up, corner = previous[i], previous[i - step] if i >= step else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                guess = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + guess) & 0xFF
        rows.append(bytes(line))
        previous = line
    return width, height, rows


def colour_share(png: bytes, rgb: tuple[int, int, int]) -> float:
    """The share of pixels within a few steps of ``rgb``."""
    width, height, rows = pixels(png)
    step = len(rows[0]) // width
    close = 0
    for row in rows:
        for x in range(0, len(row), step):
            if all(abs(row[x + c] - rgb[c]) <= 6 for c in range(3)):
                close += 1
    return close / (width * height)


# Runs alone (scripts/test): the start phases must sum to the script's own clock within 5 %.
@pytest.mark.serial
def test_the_report_page_tells_a_restarted_jobs_story(testbed: Testbed, tmp_path: Path) -> None:
    chromium()  # skip early (outside CI) when there is no browser here
    home, run_dir = tmp_path / "home", tmp_path / "run"
    cluster = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[{"host": "node1", "nproc": 1}, {"host": "node2", "nproc": 1}],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
    )
    env = dict(os.environ, HERD_HOME=str(home))
    launch = [
        sys.executable, "-m", "torchherd", "launch", "-c", str(cluster), "--max-restarts", "1",
        "--name", "crash-once", "-v", "crash_once.py", "--max-steps", "80", "--snapshot-every",
        "20", "--batch-size", "16", "--run-dir", str(run_dir),
    ]  # fmt: skip
    commanded = time.time()
    run = subprocess.run(launch, cwd=SCRIPTS, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "after 1 restart(s)" in run.stdout
    start_phases_are_explained(run.stdout, home, run_dir, commanded)

    made = subprocess.run(
        [sys.executable, "-m", "torchherd", "report", "crash-once"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    page = Path(made.stdout.split("report: ", 1)[1].strip())
    assert page.name == "report.html" and page.parent.parent.name == "jobs"
    assert f"--run-dir {run_dir}" in made.stderr  # the metrics, found from the job's arguments

    dom = browse(page, tmp_path / "profile-dom", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    reader = Page()
    reader.feed(dom.stdout)
    text = " | ".join(reader.text)
    assert re.search(r"Job \S+ succeeded after 1 restart\(s\) \(exit code 0\)", text), text
    assert "First failure: node2 rank 1: killed by SIGKILL" in text
    assert "attempt 0" in text and "attempt 1" in text
    assert "failed, world 2" in text and "succeeded, world 2" in text  # the timeline's bars
    assert "noticed: a worker exited" in text
    # Every node still answered: the next attempt ran in place, through the same agents.
    assert "in place after: node2 rank 1: killed by SIGKILL" in text
    # step rate per node: both nodes, both attempts, a number of steps per second
    # (the node's own rate where its beats were sampled twice or more, else the job's, ≈)
    rates = re.findall(
        r"(\d) \| (node[12]) \| 1 \| (\d+) \| (?:≈ )?([\d.]+) \| (?:the job|this node)", text
    )
    assert {(a, node) for a, node, _, _ in rates} == {
        ("0", "node1"), ("0", "node2"), ("1", "node1"), ("1", "node2"),
    }, text  # fmt: skip
    assert all(float(rate) > 0 for *_, rate in rates)
    assert "loss" in text and "throughput (samples/s)" in text
    # the start of each attempt, phase by phase, with the slowest node of each
    assert "Start of each attempt" in text
    assert re.search(r"0 \| ssh connect \| [\d.]+ \| \d+ % \| node[12] \([\d.]+ s\)", text)
    assert re.search(r"1 \| replan \| [\d.]+ \| \d+ % \| node[12]", text), text
    assert "1 | total (to the first step)" in text
    assert "<polyline" in dom.stdout  # the curves are drawn
    # links: every rank's log and the stacks herd took of node1 before it stopped attempt 0
    targets = {Path(unquote(urlparse(page.as_uri()).path)).parent / link for link in reader.links}
    names = {t.name for t in targets}
    assert {"rank-0.log", "rank-1.log", "output.log", "node1-rank-0.txt"} <= names, names
    assert all(t.exists() for t in targets), [t for t in targets if not t.exists()]

    png = screenshot(page, tmp_path, "report-restarted.png")
    width, height, rows = pixels(png)
    assert (width, height) == (1200, 1600)
    assert len({row for row in rows}) > 200  # not a blank page: many different lines
    assert colour_share(png, (0xD1, 0x49, 0x5B)) > 0.001  # the failed attempt's red bar
    assert colour_share(png, (0x2A, 0x9D, 0x5C)) > 0.001  # the successful restart's green


FIRST_START = [
    "launcher start", "ssh connect", "agent start", "probe", "plan", "wrapper warm", "rendezvous",
    "script start", "process-group init", "first step",
]  # fmt: skip
RESTART = ["stop", "replan", *FIRST_START[5:]]


def start_phases_are_explained(out: str, home: Path, run_dir: Path, commanded: float) -> None:
    """The start and the restart, phase by phase, in the record and on the console (-v); each
    sums to the time the script's own clock measured, within a few percent: from the command
    to the last rank's first step, and from the kill to the restart's last first step."""
    (record_file,) = (home / "jobs").glob("*/job.json")
    attempts = json.loads(record_file.read_text())["attempts"]
    first_steps = {
        attempt: max(float((run_dir / f"first-step-{attempt}-{r}").read_text()) for r in (0, 1))
        for attempt in (0, 1)
    }
    measured = [
        first_steps[0] - commanded,
        first_steps[1] - float((run_dir / "killed-at").read_text()),
    ]
    for entry, names, seconds in zip(attempts, [FIRST_START, RESTART], measured, strict=True):
        phases = entry["phases"]
        assert list(phases) == names, phases
        assert entry["start_complete"] is True
        total = sum(phases.values())
        assert total == pytest.approx(entry["start_seconds"], abs=0.01)
        # A restart is counted from the moment herd saw the kill (torchrun's monitor, the
        # agent's exit event: tenths of a second after it, up to half a second on a loaded
        # machine, where 0.32 s was seen).
        assert total == pytest.approx(seconds, rel=0.05, abs=0.5), (entry["n"], phases, seconds)
        assert set(entry["phases_slowest"]) == set(names)
        assert set(entry["phases_slowest"].values()) <= {"node1", "node2"}
        for node in entry["nodes"]:
            assert sum(node["phases"].values()) <= total + 0.01, node
    assert re.search(r"herd: start: [\d.]+ s to the first step", out), out[-3000:]
    assert re.search(r"herd: restart \(attempt 1\): [\d.]+ s to the first step", out)
    assert re.search(r"  rendezvous +[\d.]+ s +\d+ %  slowest node[12]", out), out[-3000:]


def read_page(page: Path, profile: Path) -> tuple[str, Page]:
    dom = browse(page, profile, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    reader = Page()
    reader.feed(dom.stdout)
    return " | ".join(reader.text), reader


def screenshot(page: Path, tmp_path: Path, name: str) -> bytes:
    shot = tmp_path / name
    taken = browse(
        page, tmp_path / f"profile-{name}", "--window-size=1200,1600", f"--screenshot={shot}"
    )
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    keep = os.environ.get("HERD_REPORT_SHOTS")
    if keep:
        shutil.copy(shot, Path(keep) / name)
    return shot.read_bytes()


def report_of(job: str, home: Path, cwd: Path) -> tuple[Path, str]:
    made = subprocess.run(
        [sys.executable, "-m", "torchherd", "report", job],
        cwd=cwd, env=dict(os.environ, HERD_HOME=str(home)), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return Path(made.stdout.split("report: ", 1)[1].strip()), made.stderr


def test_a_failed_jobs_page_shows_the_error_its_rank_raised(
    testbed: Testbed, tmp_path: Path
) -> None:
    chromium()
    home, run_dir = tmp_path / "home", tmp_path / "run"
    cluster = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[{"host": "node1", "nproc": 1}, {"host": "node2", "nproc": 1}],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
    )
    launch = [
        sys.executable, "-m", "torchherd", "launch", "-c", str(cluster), "--name", "bad-value",
        "bad_value.py", "--max-steps", "80", "--snapshot-every", "20", "--batch-size", "16",
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = dict(os.environ, HERD_HOME=str(home))
    run = subprocess.run(launch, cwd=SCRIPTS, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    page, said = report_of("bad-value", home, tmp_path)
    assert f"--run-dir {run_dir}" in said
    text, _ = read_page(page, tmp_path / "profile-failed")
    assert re.search(r"Job \S+ failed \(exit code 1\)", text), text
    assert "First failure: node2 rank 1: exit code 1: ValueError: bad value 42" in text, text
    assert "message | ValueError: bad value 42" in text, text  # not "message | -"
    assert "The last lines of its stderr:" in text and "in check" in text, text
    assert "hostname of the client socket" not in text and "[rank1]" not in text, text
    assert "loss (log scale)" in text and "step" in text
    assert "jobs/" in text and "/.." not in text  # the footer names the job's own folder
    png = screenshot(page, tmp_path, "report-failed.png")
    assert colour_share(png, (0xD1, 0x49, 0x5B)) > 0.001  # the failed attempt's red bar


def test_the_demos_page_shows_its_curves(tmp_path: Path) -> None:
    chromium()
    home = tmp_path / "home"
    demo = subprocess.run(
        [sys.executable, "-m", "torchherd", "demo"],
        cwd=tmp_path, env=dict(os.environ, HERD_HOME=str(home)), capture_output=True, text=True,
        timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    job = re.search(r"herd report (\S+)`", demo.stdout)
    assert job, demo.stdout
    page, said = report_of(job.group(1), home, tmp_path)
    assert "--run-dir" in said
    text, _ = read_page(page, tmp_path / "profile-demo")
    assert re.search(r"Job \S+ succeeded", text), text
    assert "loss (log scale)" in text and "throughput (samples/s)" in text, text
    assert "No curves" not in text
    # its ranks beat their steps: the step rate per node has a number
    assert re.search(r"localhost \| 2 \| 300 \| (?:≈ )?[\d.]+ \|", text), text
    screenshot(page, tmp_path, "report-demo.png")
