"""`herd doctor` on the testbed: each fault built for real, and the doctor must name the node and
the cause. A healthy testbed passes with exit 0 (warning only about the 127.0.1.1 hostnames,
which the testbed sets up on purpose)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import torchherd
from tests.testbed import Testbed
from torchherd.cli import main

# Its fixture is built once per module: xdist keeps the module's tests on one worker.
pytestmark = pytest.mark.xdist_group("doctor")

SRC = Path(torchherd.__file__).resolve().parents[1]


def doctor(
    capsys: pytest.CaptureFixture[str], path: Path, *args: str
) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = main(["doctor", "-c", str(path), "--json", *args])
    out = capsys.readouterr().out
    return code, json.loads(out)


def result(report: dict[str, Any], check: str, host: str | None) -> dict[str, Any]:
    for item in report["results"]:
        if item["check"] == check and item["host"] == host:
            return item
    raise AssertionError(f"no {check} result for {host}")


def statuses(report: dict[str, Any], check: str) -> dict[str, str]:
    return {r["host"]: r["status"] for r in report["results"] if r["check"] == check}


@pytest.fixture
def cluster_file(testbed: Testbed, tmp_path: Path) -> Iterator[Path]:
    yield testbed.write_cluster_file(tmp_path / "herd.toml", connect_timeout=2)


def test_healthy_testbed_passes(
    capsys: pytest.CaptureFixture[str], cluster_file: Path, testbed: Testbed
) -> None:
    code, report = doctor(capsys, cluster_file)
    failed = [r for r in report["results"] if r["status"] == "fail"]
    assert code == 0 and report["ok"], failed
    hosts = [n.name for n in testbed.nodes]
    for check in ("ssh", "python", "torch", "versions", "workdir", "rendezvous", "ports", "nic"):
        assert set(statuses(report, check).values()) == {"pass"}, (check, report["results"])
    for node in testbed.nodes:
        name = result(report, "hostname", node.name)
        assert name["status"] == "warn"  # the testbed's stock-Debian 127.0.1.1 line
        assert "127.0.1.1" in name["summary"] and f"--local-addr={node.addr}" in name["summary"]
        assert "MASTER_ADDR" in name["summary"]
    # Throughput in rounds of disjoint pairs: every node measured with two partners.
    measured = [(x["src"], x["dst"]) for x in report["links"] if x["gbits"]]
    for host in hosts:
        assert len({b if a == host else a for a, b in measured if host in (a, b)}) == 2
    assert report["slowest_link"]["gbits"] > 0

    # The same run for people: the table, then the remedies, exit 0.
    capsys.readouterr()
    assert main(["doctor", "-c", str(cluster_file)]) == 0
    text = capsys.readouterr().out
    assert "ssh" in text and "rdzv" in text and "node4" in text
    assert "What to do" in text and "also on node2, node3, node4" in text
    assert "ready" in text


def test_node_cut_off_the_network(
    capsys: pytest.CaptureFixture[str], cluster_file: Path, clean_faults: Testbed
) -> None:
    clean_faults.partition("node3")
    code, report = doctor(capsys, cluster_file)
    assert code == 3
    ssh = result(report, "ssh", "node3")
    assert ssh["status"] == "fail" and "timed out" in ssh["summary"]
    assert "node3" in ssh["remedy"]
    assert statuses(report, "ssh") == {
        "node1": "pass",
        "node2": "pass",
        "node3": "fail",
        "node4": "pass",
    }
    assert result(report, "python", "node3")["status"] == "skip"
    # The others are still examined, and pass.
    assert statuses(report, "rendezvous")["node4"] == "pass"


def test_missing_working_directory(
    capsys: pytest.CaptureFixture[str], testbed: Testbed, tmp_path: Path
) -> None:
    missing = tmp_path / "not-synced-yet"
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml", connect_timeout=2, workdir=str(missing), nodes=["node1", "node2"]
    )
    code, report = doctor(capsys, path)
    assert code == 3
    for name in ("node1", "node2"):
        workdir = result(report, "workdir", name)
        assert workdir["status"] == "fail" and str(missing) in workdir["summary"]
        assert "herd sync" in workdir["remedy"]


def _venv_running_this_torchherd(
    root: Path, *, with_torch: bool, version: str | None = None
) -> Path:
    """A real venv over this interpreter where this source tree's torchherd is importable.

    torchherd is installed the way pip lays out any installed distribution (a .pth naming the
    source, a dist-info whose METADATA carries the version) without building anything: a build
    would need setuptools' `wheel` support, which a stock base interpreter lacks. ``version``
    gives the installed distribution another version than this one's. ``with_torch`` makes
    this suite's torch importable too (never the base interpreter's: it has none on a fresh
    machine, and CI must not depend on one).
    """
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60
    )
    packages = next(root.glob("lib/python3*/site-packages"))
    paths = [str(SRC)]
    if with_torch:
        torch = importlib.util.find_spec("torch")
        assert torch is not None and torch.origin, "this suite's interpreter has no torch"
        paths.append(str(Path(torch.origin).parents[1]))  # after ours: our dist-info wins
    (packages / "torchherd-src.pth").write_text("\n".join(paths) + "\n")
    version = version or importlib.metadata.version("torchherd")
    info = packages / f"torchherd-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchherd\nVersion: {version}\n")
    (info / "INSTALLER").write_text("test\n")
    (info / "RECORD").write_text("")
    return root / "bin" / "python"


def _venv_without_torch(root: Path) -> Path:
    """A real venv (no system site-packages: no torch) where torchherd is importable."""
    python = _venv_running_this_torchherd(root, with_torch=False)
    probe = subprocess.run(
        [str(python), "-c", "import torchherd, importlib.util as u; print(u.find_spec('torch'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "None", probe.stderr
    return python


def test_node_whose_python_has_no_torch(
    capsys: pytest.CaptureFixture[str], testbed: Testbed, tmp_path: Path
) -> None:
    python = _venv_without_torch(tmp_path / "venv")
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        connect_timeout=2,
        nodes=["node1", "node2", {"host": "node3", "python": str(python)}, "node4"],
    )
    code, report = doctor(capsys, path)
    assert code == 3
    torch = result(report, "torch", "node3")
    assert torch["status"] == "fail"
    assert f"torch is not installed for {python}" in torch["summary"]
    assert statuses(report, "torch") == {
        "node1": "pass",
        "node2": "pass",
        "node3": "fail",
        "node4": "pass",
    }


def test_node_whose_python_has_neither_torchherd_nor_torch(
    capsys: pytest.CaptureFixture[str], testbed: Testbed, tmp_path: Path
) -> None:
    # A bare venv (no system site-packages) rather than the system's python3: that one may
    # well have torch, and this fault must be built wherever the suite runs.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")],
        check=True,
        timeout=60,
    )
    bare = str(tmp_path / "bare" / "bin" / "python")
    check = "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('torchherd'))"
    found = subprocess.run([bare, "-c", check], capture_output=True, text=True, timeout=60)
    assert found.stdout.split() == ["None", "None"], (found.stdout, found.stderr)
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        connect_timeout=2,
        nodes=["node1", {"host": "node2", "python": bare}],
    )
    code, report = doctor(capsys, path)
    assert code == 3
    python = result(report, "python", "node2")
    assert python["status"] == "fail"
    assert f"torchherd and torch are not installed for {bare}" in python["summary"]
    assert "pip install torchherd torch" in python["remedy"]
    assert result(report, "torch", "node2")["status"] == "fail"
    assert result(report, "python", "node1")["status"] == "pass"


@pytest.fixture(scope="module")
def other_version_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv (with this suite's torch) where torchherd is installed as version 0.1.0.post1."""
    root = tmp_path_factory.mktemp("other-version") / "venv"
    python = _venv_running_this_torchherd(root, with_torch=True, version="0.1.0.post1")
    answer = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('torchherd'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert answer.stdout.strip() == "0.1.0.post1", answer.stderr
    return python


def test_node_whose_environment_differs_in_versions(
    capsys: pytest.CaptureFixture[str], testbed: Testbed, tmp_path: Path, other_version_python: Path
) -> None:
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        connect_timeout=2,
        nodes=["node1", "node2", {"host": "node3", "python": str(other_version_python)}, "node4"],
    )
    code, report = doctor(capsys, path)
    assert code == 3
    versions = result(report, "versions", "node3")
    assert versions["status"] == "fail"
    assert "torchherd 0.1.0.post1 here" in versions["summary"]
    assert "node1, node2, node4" in versions["summary"]
    assert report["versions"] == {
        "torchherd": {
            "node1": torchherd.__version__,
            "node2": torchherd.__version__,
            "node3": "0.1.0.post1",
            "node4": torchherd.__version__,
        }
    }
    assert statuses(report, "versions")["node1"] == "pass"
    assert result(report, "torch", "node3")["status"] == "pass"  # only the version differs

    # herd launch runs the fast subset and refuses, unless told not to.
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    capsys.readouterr()
    assert main(["launch", "-c", str(path), "--dry-run", str(script)]) == 3
    err = capsys.readouterr().err
    assert "node3: torchherd 0.1.0.post1 here" in err and "--no-preflight" in err
    assert main(["launch", "-c", str(path), "--dry-run", "--no-preflight", str(script)]) == 0


def test_rendezvous_port_blocked_on_the_rendezvous_node(
    capsys: pytest.CaptureFixture[str], clean_faults: Testbed, tmp_path: Path
) -> None:
    port = 29611
    path = clean_faults.write_cluster_file(
        tmp_path / "herd.toml", connect_timeout=2, rdzv_port=port
    )
    clean_faults.block_port("node1", port)
    code, report = doctor(capsys, path)
    assert code == 3
    host = result(report, "rendezvous", "node1")
    assert host["status"] == "fail"
    assert f":{port}" in host["summary"] and "no other node can connect" in host["summary"]
    assert "timed out" in host["summary"] and "firewall" in host["remedy"]
    for name in ("node2", "node3", "node4"):
        node = result(report, "rendezvous", name)
        assert (
            node["status"] == "fail"
            and f"node1 {clean_faults.node('node1').addr}:{port}" in node["summary"]
        )
    # Only the store port is blocked: ephemeral ports still work.
    assert set(statuses(report, "ports").values()) == {"pass"}


def test_node_asking_for_more_workers_than_it_can_run(
    capsys: pytest.CaptureFixture[str], testbed: Testbed, tmp_path: Path
) -> None:
    cores = len(os.sched_getaffinity(0))
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        connect_timeout=2,
        nodes=["node1", "node2", "node3", {"host": "node4", "nproc": cores + 6}],
    )
    code, report = doctor(capsys, path)
    workers = result(report, "workers", "node4")
    assert workers["status"] == "warn"  # CPU workers can share cores; GPUs cannot (unit tests)
    assert f"{cores + 6} workers" in workers["summary"]
    assert f"{cores} CPU core" in workers["summary"]
    assert f"nproc = {cores}" in workers["remedy"]
    assert statuses(report, "workers")["node1"] == "pass"
    assert code == 0


def test_collective_runs_a_real_all_reduce(
    capsys: pytest.CaptureFixture[str], testbed: Testbed, tmp_path: Path
) -> None:
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml", connect_timeout=2, nodes=["node1", "node2"]
    )
    code, report = doctor(capsys, path, "--collective")
    collective = result(report, "collective", None)
    assert code == 0, collective
    assert collective["status"] == "pass" and "gloo" in collective["summary"]
    assert collective["data"]["world_size"] == 2
    rows = report["collective"]
    assert [r["size_bytes"] for r in rows] == [4 << 10, 256 << 10, 4 << 20, 32 << 20]
    for row in rows:
        assert row["busbw_gbytes"] == pytest.approx(row["algbw_gbytes"] * 2 * (2 - 1) / 2)
        assert row["busbw_gbytes"] > 0


def test_full_tests_every_pair(capsys: pytest.CaptureFixture[str], cluster_file: Path) -> None:
    code, report = doctor(capsys, cluster_file, "--full")
    assert code == 0
    pairs = {(x["src"], x["dst"]) for x in report["links"] if x["purpose"] == "ephemeral"}
    hosts = [f"node{k}" for k in range(1, 5)]
    assert pairs == {(a, b) for a in hosts for b in hosts if a != b}
    measured = {frozenset((x["src"], x["dst"])) for x in report["links"] if x["gbits"]}
    assert len(measured) == 6  # every pair once


def test_faults_built_for_real_nic_ifname_slow_link_and_port_in_use(
    capsys: pytest.CaptureFixture[str], clean_faults: Testbed, tmp_path: Path
) -> None:
    """Each fault the unit tests judge on recorded facts, built on the testbed instead: a
    docker bridge chosen as NCCL's NIC, NCCL_SOCKET_IFNAME naming no NIC, a slow link and the
    rendezvous port taken by another process."""
    bed = clean_faults
    bed.add_nic("node2", "docker0", "172.31.0.1/16")
    bed.delay("node3", 40)
    port = 29633
    listener = bed.ns_popen(
        "node1",
        [
            sys.executable,
            "-c",
            "import socket, time\n"
            f"s = socket.socket(); s.bind(('', {port})); s.listen(); print('ready', flush=True)\n"
            "time.sleep(300)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "ready"
        path = bed.write_cluster_file(
            tmp_path / "herd.toml",
            connect_timeout=5,
            rdzv_port=port,
            nodes=["node1", {"host": "node2", "iface": "docker0"}, "node3", "node4"],
        )
        code, report = doctor(capsys, path)
        wrong = bed.write_cluster_file(
            tmp_path / "wrong.toml",
            connect_timeout=5,
            nodes=["node1", "node4"],
            env={"NCCL_SOCKET_IFNAME": "ib0"},
        )
        wrong_code, wrong_report = doctor(capsys, wrong)
    finally:
        listener.kill()
        listener.wait(timeout=10)
    assert code == 3
    docker = result(report, "nic", "node2")
    assert docker["status"] == "warn" and "docker0" in docker["summary"], docker
    assert result(report, "nic", "node4")["status"] == "pass"
    taken = result(report, "rendezvous", "node1")
    assert taken["status"] == "fail" and "in use" in taken["summary"], taken
    rtts = {x["dst"]: x["rtt_ms"] for x in report["links"] if x["rtt_ms"] is not None}
    assert rtts["node3"] >= 40 > rtts["node4"], rtts  # the slow link is the one measured slow
    assert wrong_code == 3
    for node in ("node1", "node4"):
        nic = result(wrong_report, "nic", node)
        assert nic["status"] == "fail" and "NCCL_SOCKET_IFNAME=ib0" in nic["summary"], nic


def test_firewalled_ephemeral_ports_are_placed_on_the_receiving_node(
    capsys: pytest.CaptureFixture[str], clean_faults: Testbed, tmp_path: Path
) -> None:
    """node3 drops incoming TCP to the kernel's whole ephemeral range (NCCL/Gloo's data ports),
    while ssh and the rendezvous port stay open: only the ports check fails, on node3."""
    low, high = ip_local_port_range(clean_faults, "node3")
    clean_faults.block_port("node3", f"{low}:{high}")
    path = clean_faults.write_cluster_file(
        tmp_path / "herd.toml", connect_timeout=5, nodes=["node1", "node2", "node3"]
    )
    code, report = doctor(capsys, path, "--full")
    assert code == 3
    ports = statuses(report, "ports")
    assert ports["node3"] == "fail" and ports["node1"] == ports["node2"] == "pass", ports
    assert set(statuses(report, "ssh").values()) == {"pass"}
    assert set(statuses(report, "rendezvous").values()) == {"pass"}


def ip_local_port_range(bed: Testbed, node: str) -> tuple[int, int]:
    out = bed.ns_run(node, ["cat", "/proc/sys/net/ipv4/ip_local_port_range"]).stdout.split()
    return int(out[0]), int(out[1])
