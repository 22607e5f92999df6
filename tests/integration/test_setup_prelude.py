"""The setup prelude over ssh: `[cluster] setup` (and per node) runs in the shell that starts
each agent, so what it exports reaches the job; a failing one is reported per node, with its
output, before anything starts."""

from __future__ import annotations

from pathlib import Path

from tests.integration.herd_cli import herd
from tests.testbed import Testbed

JOB = """\
import os
print("SEEN", os.environ.get("HERD_NODE"), os.environ.get("FROM_SETUP"),
      os.environ.get("FROM_NODE", "-"), flush=True)
"""


def test_setup_runs_before_every_agent(testbed: Testbed, tmp_path: Path) -> None:
    activate = tmp_path / "activate"
    activate.write_text("export FROM_SETUP=cluster-wide\necho activated\n")
    (tmp_path / "job.py").write_text(JOB)
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[
            {"host": "node1", "nproc": 1},
            {"host": "node2", "nproc": 1, "setup": "export FROM_NODE=node2-only"},
        ],
        setup=f". {activate}",
        workdir=str(tmp_path),
    )
    done = herd(["launch", "-c", str(path), "job.py"], tmp_path / "home", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = sorted(line.split("SEEN ", 1)[1] for line in done.stdout.splitlines() if "SEEN" in line)
    assert seen == ["node1 cluster-wide -", "node2 cluster-wide node2-only"], done.stdout


def test_failing_setup_is_reported_per_node_before_start(testbed: Testbed, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[
            {"host": "node1", "nproc": 1},
            {"host": "node2", "nproc": 1, "setup": "echo 'cuda/99.9: no such module' >&2; false"},
        ],
        workdir=str(tmp_path),
    )
    home = tmp_path / "home"
    done = herd(["launch", "-c", str(path), "job.py"], home, tmp_path)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "node2: the setup commands failed; their output:" in done.stderr
    assert "cuda/99.9: no such module" in done.stderr
    assert "node1:" not in done.stderr  # only the node whose setup failed is named
    assert "SEEN" not in done.stdout  # nothing started anywhere
    assert not (home / "jobs").exists()
