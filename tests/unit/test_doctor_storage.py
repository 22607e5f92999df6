"""`herd doctor --path`: the node side on real directories, and the judgement over recorded
findings (shared, node-local, partly shared, missing, unwritable, URLs)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from torchherd.agent import storage as agent_storage
from torchherd.preflight import (
    CheckResult,
    Findings,
    Limits,
    PathOnNode,
    ProbeFailure,
    Status,
    StorageFindings,
    make_report,
)
from torchherd.preflight.render import render
from torchherd.preflight.storage import is_url
from torchherd.preflight.storage_checks import storage
from torchherd.spec import ClusterSpec, NodeSpec

HOSTS = ["node1", "node2", "node3"]
GB = 10**9


def findings(found: StorageFindings, **extra: object) -> Findings:
    cluster = ClusterSpec(nodes=tuple(NodeSpec(host=h) for h in HOSTS), source="test")
    return Findings(cluster=cluster, facts={}, storage=(found,), **extra)  # type: ignore[arg-type]


def ok(seen: str | None, free: int = 500 * GB, path: str = "/data/run") -> PathOnNode:
    return PathOnNode(path, "ok", free_bytes=free, total_bytes=1000 * GB, seen=seen)


def judged(found: StorageFindings, **extra: object) -> dict[str, CheckResult]:
    return {str(r.host): r for r in storage(findings(found, **extra))}


def from_node1(node2: PathOnNode, node3: PathOnNode, path: str = "/data/run") -> StorageFindings:
    """node1 wrote the token; what node2 and node3 found."""
    return StorageFindings(path, {"node1": ok(None), "node2": node2, "node3": node3}, "node1")


# ---------------------------------------------------------------------------- judgement


def test_shared_everywhere_passes_with_free_space() -> None:
    results = judged(from_node1(ok("found"), ok("found")))
    for host in HOSTS:
        result = results[host]
        assert result.status is Status.PASS, result
        assert "shared by all 3 nodes" in result.summary
        assert result.data["free_bytes"] == 500 * GB
        assert result.data["shared_with"] == HOSTS


def test_node_local_everywhere_warns_every_node_with_what_breaks_and_the_fix() -> None:
    results = judged(from_node1(ok("absent"), ok("absent"), "~/runs"))
    for host in HOSTS:
        result = results[host]
        assert result.status is Status.WARN, result
        assert "resumes from nothing" in result.summary
        remedy = result.remedy
        assert "shared filesystem" in remedy and "s3://" in remedy
        assert 'snapshot_scope="node"' in remedy and "~/runs" in remedy
    assert "no other node sees" in results["node1"].summary
    assert "node-local" in results["node2"].summary
    # One remedy for the whole cluster: the report groups them.
    assert len({r.remedy for r in results.values()}) == 1


def test_partly_shared_warns_only_the_nodes_that_do_not_see_the_token() -> None:
    results = judged(from_node1(ok("found"), ok("other-content")))
    assert results["node1"].status is Status.PASS
    assert "shared with node2" in results["node1"].summary
    assert results["node2"].status is Status.PASS
    assert results["node3"].status is Status.WARN
    assert "a different file" in results["node3"].summary
    assert results["node1"].data["not_shared_with"] == ["node3"]


def test_missing_and_unwritable_fail_with_the_fix() -> None:
    missing = PathOnNode("/data/run", "missing", "No such file or directory")
    read_only = PathOnNode("/data/run", "unwritable", "Read-only file system", 5, 9)
    results = judged(from_node1(missing, read_only))
    missing, unwritable = results["node2"], results["node3"]
    assert missing.status is Status.FAIL
    assert "does not exist" in missing.summary
    assert "mkdir -p /data/run" in missing.remedy
    assert unwritable.status is Status.FAIL
    assert "Read-only file system" in unwritable.summary
    assert "writable" in unwritable.remedy
    # The only node that can write has nobody to share with: not a node-local warning.
    assert results["node1"].status is Status.PASS


def test_low_space_fails_below_one_gb_and_warns_below_the_limit() -> None:
    found = StorageFindings(
        "/data/run",
        {"node1": ok(None, free=GB // 2), "node2": ok("found", free=3 * GB), "node3": ok("found")},
        writer="node1",
    )
    results = judged(found, limits=Limits(min_disk_gb=10))
    assert results["node1"].status is Status.FAIL
    assert results["node2"].status is Status.WARN
    assert "3.0 GB free" in results["node2"].summary
    assert results["node3"].status is Status.PASS


def test_a_node_that_did_not_answer_warns_and_names_a_hung_mount() -> None:
    hung = PathOnNode("", "no-answer", "no answer within 60 s")
    gone = PathOnNode("", "no-answer", "the node's agent session had ended")
    results = judged(from_node1(hung, gone))
    assert results["node2"].status is Status.WARN
    assert "hung network filesystem" in results["node2"].summary
    assert "ls /data/run" in results["node2"].remedy
    assert results["node3"].status is Status.WARN
    assert "hung" not in results["node3"].summary


def test_urls_are_left_to_the_job_and_unprobed_nodes_are_skipped() -> None:
    assert is_url("s3://bucket/run") and is_url("gs://b/p")
    assert not is_url("file:///data/run") and not is_url("/data/run") and not is_url("~/r")
    results = judged(StorageFindings("s3://bucket/run", url=True))
    assert {r.status for r in results.values()} == {Status.SKIP}
    assert "not a filesystem path" in results["node1"].summary
    partial = StorageFindings("/data/run", {"node1": ok(None)}, writer="node1")
    assert judged(partial)["node2"].status is Status.SKIP


def test_the_table_shows_the_storage_column_only_when_paths_were_checked() -> None:
    cluster = ClusterSpec(nodes=tuple(NodeSpec(host=h) for h in HOSTS), source="test")
    # No probe facts recorded here: the other checks see a probe that failed, and skip.
    failed = {h: ProbeFailure(h, "python3", "timeout", "no answer") for h in HOSTS}
    found = from_node1(ok("absent"), ok("found"))

    def text(report_findings: Findings, verbose: bool) -> str:
        out = io.StringIO()
        render(make_report(report_findings), Console(file=out, width=200), verbose=verbose)
        return out.getvalue()

    without = text(Findings(cluster=cluster, facts={}, probe_failures=failed), verbose=False)
    assert "store" not in without.splitlines()[0]
    with_paths = text(
        Findings(cluster=cluster, facts={}, probe_failures=failed, storage=(found,)), verbose=True
    )
    assert "store" in with_paths.splitlines()[0]
    assert "500.0 GB free in /data/run" in with_paths  # -v: free space per node
    assert "node2 storage: /data/run: not the storage node1 writes to" in with_paths
    report = make_report(
        Findings(cluster=cluster, facts={}, probe_failures=failed, storage=(found,))
    ).to_dict()
    rows = [r for r in report["results"] if r["check"] == "storage"]
    assert [r["data"]["free_bytes"] for r in rows] == [500 * GB] * 3
    json.dumps(report)


# ---------------------------------------------------------------------------- the node side


def test_place_look_clean_on_real_directories(tmp_path: Path) -> None:
    shared, other = tmp_path / "shared", tmp_path / "other"
    shared.mkdir()
    other.mkdir()
    placed = agent_storage.handle(
        {"place": ["shared", "nothere", str(other)], "base": str(tmp_path)}
    )
    here, missing, elsewhere = placed["paths"]
    assert here["state"] == "ok" and here["path"] == str(shared)
    assert here["free_bytes"] > 0 and here["total_bytes"] >= here["free_bytes"]
    token = shared / here["token"]
    assert token.read_text() == here["content"]
    assert missing["state"] == "missing" and "No such file" in missing["error"]

    same = {"path": str(shared), "name": here["token"], "content": here["content"]}
    # The same directory sees the token; another directory under the same name does not.
    looked = agent_storage.handle(
        {
            "look": [
                same,
                {**same, "path": str(other)},
                {**same, "content": "something else"},
                {**same, "name": "../../etc/passwd"},
            ]
        }
    )["paths"]
    assert [x["seen"] for x in looked] == ["found", "absent", "other-content", "absent"]

    agent_storage.handle({})
    assert not token.exists()
    assert not any(p.name.startswith(".herd-storage-") for p in other.iterdir())


def test_unwritable_and_not_a_directory(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes through permission bits; sysfs refuses new files to all
        locked = Path("/sys")
    afile = tmp_path / "afile"
    afile.write_text("x")
    answers = agent_storage.handle({"place": [str(locked), str(afile)]})["paths"]
    assert answers[0]["state"] == "unwritable" and answers[0]["error"], answers[0]
    assert answers[1]["state"] == "not-a-dir"


def test_tilde_expands_for_the_node_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    answer = agent_storage.place("~", "/somewhere/else")
    assert answer["path"] == str(tmp_path) and answer["state"] == "ok"
    agent_storage.clean()
