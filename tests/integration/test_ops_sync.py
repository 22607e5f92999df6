"""`herd sync` on the testbed: rsync over the real ssh links.

Every testbed node shares this machine's filesystem, so real copying is tested by syncing
tmp/src into a different workdir (tmp/dst), and skipping by syncing a directory onto itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.integration.herd_cli import herd
from tests.testbed import Testbed


def make_project(root: Path) -> Path:
    src = root / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "data").mkdir()
    (src / ".git").mkdir()
    (src / "train.py").write_text("print('train')\n")
    (src / "pkg" / "model.py").write_text("W = 1\n" * 1000)
    (src / "data" / "shard.bin").write_bytes(os.urandom(200_000))  # ignored by .gitignore
    (src / "run.log").write_text("noise\n")  # ignored by .gitignore
    (src / "notes.tmp").write_text("excluded on the command line\n")
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (src / ".gitignore").write_text("data/\n*.log\n")
    return src


def test_sync_copies_honours_ignores_and_repeats_cheaply(testbed: Testbed, tmp_path: Path) -> None:
    src = make_project(tmp_path)
    dst = tmp_path / "dst"
    config = testbed.write_cluster_file(
        tmp_path / "herd.toml", nodes=["node1", "node2", "node3"], workdir=str(dst)
    )
    first = herd(
        ["sync", str(src), "-c", str(config), "--exclude", "*.tmp", "--json"], tmp_path, tmp_path
    )
    assert first.returncode == 0, first.stderr
    results = {r["host"]: r for r in json.loads(first.stdout)["results"]}
    # One filesystem under all three nodes: the first is copied to, the others see its copy.
    assert results["node1"]["status"] == "copied"
    assert results["node1"]["bytes_sent"] > 6000 and results["node1"]["files"] == 3
    for name in ("node2", "node3"):
        assert results[name]["status"] == "skipped"
        assert results[name]["detail"] == "same filesystem as node1"
    # The files arrived, as every node sees them; ignored and excluded ones did not.
    listing = testbed.ssh("node3", f"cd {dst} && find . -type f | sort").stdout.split()
    assert listing == ["./.gitignore", "./pkg/model.py", "./train.py"]
    assert not list(src.glob(".herd-sync-*")) and not list(dst.glob(".herd-sync-*"))

    second = herd(
        ["sync", str(src), "-c", str(config), "--exclude", "*.tmp", "--json"], tmp_path, tmp_path
    )
    again = json.loads(second.stdout)["results"][0]
    assert again["status"] == "copied" and again["files"] == 0
    assert again["bytes_sent"] < results["node1"]["bytes_sent"] / 5  # almost nothing

    (src / "train.py").write_text("print('changed')\n")
    third = herd(["sync", str(src), "-c", str(config), "--exclude", "*.tmp"], tmp_path, tmp_path)
    assert third.returncode == 0, third.stderr
    assert (dst / "train.py").read_text() == "print('changed')\n"
    header, *rows = [line.split() for line in third.stdout.splitlines()[1:] if line.strip()]
    assert header == ["HOST", "RESULT", "SENT", "FILES", "TIME"]
    assert rows[0][:2] == ["node1", "copied"] and rows[0][4] == "1"  # SENT is "N B": 2 words


def test_sync_skips_nodes_that_see_the_source_itself(testbed: Testbed, tmp_path: Path) -> None:
    src = make_project(tmp_path)
    config = testbed.write_cluster_file(
        tmp_path / "herd.toml", nodes=["node1", "node2"], workdir=str(src)
    )
    out = herd(["sync", str(src), "-c", str(config), "--json"], tmp_path, tmp_path)
    assert out.returncode == 0, out.stderr
    for result in json.loads(out.stdout)["results"]:
        assert result["status"] == "skipped" and result["bytes_sent"] == 0
        assert "sees this directory" in result["detail"]
    assert not list(src.glob(".herd-sync-*"))


def test_sync_of_a_missing_directory_is_a_usage_error(testbed: Testbed, tmp_path: Path) -> None:
    config = testbed.write_cluster_file(tmp_path / "herd.toml")
    out = herd(["sync", str(tmp_path / "nope"), "-c", str(config)], tmp_path, tmp_path)
    assert out.returncode == 2 and "is not a directory" in out.stderr
    assert "Traceback" not in out.stderr
