"""`herd doctor --path` on the testbed: shared, node-local, partly shared, read-only and missing
directories, each built for real. The nodes share the machine's filesystem, so any directory is
shared storage; a tmpfs mounted in a node's own mount namespace (the one its sshd and so its
ssh sessions live in) makes a directory node-local there."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.testbed import Testbed
from torchherd.cli import main


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = main(["doctor", "--json", "--min-disk-gb", "0", *args])
    return code, json.loads(capsys.readouterr().out)


def storage_results(report: dict[str, Any], path: Path | str) -> dict[str, dict[str, Any]]:
    return {
        r["host"]: r
        for r in report["results"]
        if r["check"] == "storage" and r["data"]["path"] == str(path)
    }


@contextmanager
def node_mount(testbed: Testbed, node: str, directory: Path, *options: str) -> Iterator[None]:
    """A fresh tmpfs at ``directory`` seen by ``node`` only (its mount namespace)."""
    testbed.ns_run(node, ["mount", "-t", "tmpfs", *options, "tmpfs", str(directory)])
    try:
        yield
    finally:
        testbed.ns_run(node, ["umount", str(directory)], check=False)


def tokens_left(testbed: Testbed, node: str, directory: Path) -> list[str]:
    listing = testbed.ns_run(node, ["ls", "-A", str(directory)]).stdout.split()
    return [name for name in listing if name.startswith(".herd-storage-")]


def test_shared_node_local_and_partly_shared_are_told_apart(
    capsys: pytest.CaptureFixture[str], testbed: Testbed, tmp_path: Path
) -> None:
    cluster = testbed.write_cluster_file(tmp_path / "herd.toml", connect_timeout=2)
    hosts = [n.name for n in testbed.nodes]
    shared, local, partly = tmp_path / "shared", tmp_path / "local", tmp_path / "partly"
    for directory in (shared, local, partly):
        directory.mkdir()
    with ExitStack() as mounts:
        for host in hosts:
            mounts.enter_context(node_mount(testbed, host, local))
        for host in hosts[2:]:
            mounts.enter_context(node_mount(testbed, host, partly))
        code, report = doctor(
            capsys, "-c", str(cluster), "--path", str(shared), "--path", str(local),
            "--path", str(partly), "--path", "s3://bucket/run",
        )  # fmt: skip
        for host in hosts:
            assert tokens_left(testbed, host, local) == [], host
            assert tokens_left(testbed, host, partly) == [], host
    assert code == 0, [r for r in report["results"] if r["status"] == "fail"]
    assert not [p for p in shared.iterdir()], "tokens left in the shared directory"

    on_shared = storage_results(report, shared)
    assert {r["status"] for r in on_shared.values()} == {"pass"}, on_shared
    for host in hosts:
        assert on_shared[host]["data"]["shared_with"] == hosts
        assert on_shared[host]["data"]["free_bytes"] > 0
        assert "shared by all 4 nodes" in on_shared[host]["summary"]

    on_local = storage_results(report, local)
    assert {r["status"] for r in on_local.values()} == {"warn"}, on_local
    for host in hosts:
        assert on_local[host]["data"]["shared_with"] == ([host] if host == "node1" else ["node1"])
        assert "resumes from nothing" in on_local[host]["summary"]
        assert 'snapshot_scope="node"' in on_local[host]["remedy"]

    on_partly = storage_results(report, partly)
    status = {h: r["status"] for h, r in on_partly.items()}
    assert status == {"node1": "pass", "node2": "pass", "node3": "warn", "node4": "warn"}
    assert on_partly["node1"]["data"]["not_shared_with"] == ["node3", "node4"]

    on_url = storage_results(report, "s3://bucket/run")
    assert {r["status"] for r in on_url.values()} == {"skip"}
    assert "not a filesystem path" in on_url["node1"]["summary"]


def test_missing_and_read_only_directories_fail(
    capsys: pytest.CaptureFixture[str], testbed: Testbed, tmp_path: Path
) -> None:
    cluster = testbed.write_cluster_file(tmp_path / "herd.toml", connect_timeout=2)
    missing, read_only = tmp_path / "missing", tmp_path / "read-only"
    read_only.mkdir()
    with node_mount(testbed, "node3", read_only, "-o", "ro"):
        code, report = doctor(
            capsys, "-c", str(cluster), "--path", str(missing), "--path", str(read_only)
        )
    assert code == 3 and not report["ok"]
    on_missing = storage_results(report, missing)
    assert {r["status"] for r in on_missing.values()} == {"fail"}
    assert "does not exist" in on_missing["node2"]["summary"]
    assert f"mkdir -p {missing}" in on_missing["node2"]["remedy"]
    on_read_only = storage_results(report, read_only)
    assert on_read_only["node3"]["status"] == "fail", on_read_only["node3"]
    assert "Read-only file system" in on_read_only["node3"]["summary"]
    # The others write there and see each other's token: node3's trouble is its own.
    assert {on_read_only[h]["status"] for h in ("node1", "node2", "node4")} == {"pass"}
