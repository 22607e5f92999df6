"""`herd sync` on the testbed: rsync over the real ssh links.

The shared testbed's nodes share this machine's filesystem, so there real copying is tested by
syncing tmp/src into a different workdir (tmp/dst), and skipping by syncing a directory onto
itself. A second testbed gives each node its own directory at one path (a bind mount in each
node's mount namespace), where sync, --delete and a launch must reach every node's own copy.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import require_testbed
from tests.integration.herd_cli import herd
from tests.testbed import Testbed

# Its fixture is built once per module: xdist keeps the module's tests on one worker.
pytestmark = pytest.mark.xdist_group("ops_sync")


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


@pytest.fixture(scope="module")
def separate_machines() -> Iterator[Testbed]:
    """Two nodes that each have their own directory at the same path (bed.private), as
    separate machines have their own disks; the launcher has yet another one there."""
    require_testbed()
    with Testbed(2, private_dirs=True) as bed:
        yield bed


def test_sync_and_launch_on_nodes_with_their_own_disks(
    separate_machines: Testbed, tmp_path: Path
) -> None:
    bed = separate_machines
    src = make_project(tmp_path)
    (src / "where.py").write_text(
        "import os, socket\n"
        "print('RESULT', os.environ['RANK'], socket.gethostname(), open('marker').read(),"
        " flush=True)\n"
    )
    workdir = bed.private / "project"
    config = bed.write_cluster_file(tmp_path / "herd.toml", workdir=str(workdir))
    home = tmp_path / "home"
    out = herd(["sync", str(src), "-c", str(config), "--json"], home, tmp_path)
    assert out.returncode == 0, out.stderr
    results = {r["host"]: r for r in json.loads(out.stdout)["results"]}
    # Not one filesystem: every node is copied to, each into its own disk.
    assert [results[n]["status"] for n in ("node1", "node2")] == ["copied", "copied"], results
    for node in ("node1", "node2"):
        copy = bed.private_of(node) / "project"
        assert (copy / "train.py").read_text() == "print('train')\n"
        (copy / "marker").write_text(f"disk-of-{node}")
    assert not workdir.exists()  # the launcher's own directory at that path got nothing

    # A launch runs each node's workers in that node's own workdir.
    run = herd(["launch", "-c", str(config), "where.py"], home, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    seen = set(re.findall(r"RESULT (\d) (node\d) (\S+)", run.stdout))
    assert seen == {("0", "node1", "disk-of-node1"), ("1", "node2", "disk-of-node2")}, run.stdout

    # --delete removes, on every node, what the source no longer has; without it, it stays.
    (src / "train.py").unlink()
    out = herd(["sync", str(src), "-c", str(config)], home, tmp_path)
    assert out.returncode == 0, out.stderr
    assert all((bed.private_of(n) / "project" / "train.py").exists() for n in ("node1", "node2"))
    out = herd(["sync", str(src), "-c", str(config), "--delete"], home, tmp_path)
    assert out.returncode == 0, out.stderr
    for node in ("node1", "node2"):
        copy = bed.private_of(node) / "project"
        assert not (copy / "train.py").exists(), node
        assert (copy / "where.py").exists() and (copy / "pkg" / "model.py").exists()

    # The script missing on one node only: preflight names that node, and only that one.
    (bed.private_of("node2") / "project" / "where.py").unlink()
    run = herd(["launch", "-c", str(config), "where.py"], home, tmp_path)
    assert run.returncode == 3, run.stdout + run.stderr
    assert f"node2: script where.py not found in {workdir}" in run.stderr
    assert "node1: script" not in run.stderr
