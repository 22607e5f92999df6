"""`herd exec` and `herd top --once` on the testbed: real sshd, commands in parallel."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from tests.integration.herd_cli import herd
from tests.testbed import Testbed


def test_exec_on_three_nodes_with_one_failing(testbed: Testbed, tmp_path: Path) -> None:
    config = testbed.write_cluster_file(tmp_path / "herd.toml", nodes=["node1", "node2", "node3"])
    # node2 fails; every node prints its hostname on stdout and a line on stderr.
    command = 'hostname; echo "to stderr" >&2; test "$(hostname)" != node2'
    out = herd(["exec", "-c", str(config), "--", command], tmp_path, tmp_path)
    assert out.returncode == 1, out.stderr
    for name in ("node1", "node2", "node3"):
        assert f"{name} | {name}" in out.stdout  # output prefixed by host
        assert f"{name} | to stderr" in out.stderr
    rows = {
        line.split()[0]: line.split()
        for line in out.stdout.splitlines()
        if line.split() and line.split()[0] in ("node1", "node2", "node3") and "|" not in line
    }
    assert rows["node1"][1] == "0" and rows["node1"][3] == "ok"
    assert rows["node2"][1] == "1" and rows["node2"][3] == "failed"
    assert rows["node3"][1] == "0" and rows["node3"][3] == "ok"
    assert all(rows[n][2].endswith("s") for n in rows)  # a duration per node


def test_exec_json_runs_in_the_workdir_and_selects_nodes(testbed: Testbed, tmp_path: Path) -> None:
    workdir = tmp_path / "project"
    workdir.mkdir()
    (workdir / "requirements.txt").write_text("torchherd\n")
    config = testbed.write_cluster_file(tmp_path / "herd.toml", workdir=str(workdir))
    out = herd(
        [
            "exec",
            "-c",
            str(config),
            "--nodes",
            "node2,node4",
            "--json",
            "--",
            "cat",
            "requirements.txt",
        ],
        tmp_path,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["ok"] is True
    assert [r["host"] for r in result["results"]] == ["node2", "node4"]
    assert all(r["stdout"] == "torchherd\n" and r["exit_code"] == 0 for r in result["results"])


def test_exec_timeout_ends_the_remote_command(testbed: Testbed, tmp_path: Path) -> None:
    config = testbed.write_cluster_file(tmp_path / "herd.toml", nodes=["node1", "node3"])
    tag = uuid.uuid4().hex
    started = time.monotonic()
    out = herd(
        ["exec", "-c", str(config), "--timeout", "1", "--", f"HERD_TEST_TAG={tag} sleep 60"],
        tmp_path,
        tmp_path,
    )
    assert out.returncode == 1
    assert time.monotonic() - started < 30
    assert out.stdout.count("timeout") == 2
    deadline = time.monotonic() + 10
    while testbed.processes_with_env("HERD_TEST_TAG", tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert testbed.processes_with_env("HERD_TEST_TAG", tag) == []  # gone on the nodes too


def test_exec_without_a_command_is_a_usage_error(tmp_path: Path) -> None:
    out = herd(["exec"], tmp_path, tmp_path)
    assert out.returncode == 2
    assert "no command given" in out.stderr and "Traceback" not in out.stderr


def test_top_once_prints_a_row_per_node(testbed: Testbed, tmp_path: Path) -> None:
    config = testbed.write_cluster_file(tmp_path / "herd.toml")
    out = herd(["top", "-c", str(config), "--once"], tmp_path, tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["HOST", "CPU%", "MEM"]
    rows = [line.split() for line in lines[1:] if line.strip()]
    assert [row[0] for row in rows] == [n.name for n in testbed.nodes]
    for row in rows:
        assert 0 <= float(row[1]) <= 100  # CPU %
        used, total = row[2].split("/")
        assert 0 < float(used) <= float(total)
        assert row[3] == "none"  # no GPUs on the testbed: CPU and memory only
    data = json.loads(
        herd(
            ["top", "-c", str(config), "--once", "--json", "--nodes", "node1"], tmp_path, tmp_path
        ).stdout
    )
    assert [d["host"] for d in data] == ["node1"] and data[0]["gpus"] == []
    assert data[0]["mem_total"] > 0 and data[0]["error"] is None
