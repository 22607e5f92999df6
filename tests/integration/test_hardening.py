"""Hardening on the testbed: the rendezvous exposure, host keys, files at rest, secrets kept off
the nodes' disks, a ~/ interpreter.

Every test runs the real `herd` command against the namespaced nodes and their real sshd.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import torchherd
from tests.integration.herd_cli import herd
from tests.testbed import Testbed

SCRIPTS = Path(__file__).parent / "scripts"


def cluster(testbed: Testbed, tmp_path: Path, nodes: list[str], **keys: object) -> Path:
    return testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=list(nodes),
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(tmp_path / "home")},
        **keys,
    )


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_launch_refuses_a_public_address_on_the_rendezvous_node(
    clean_faults: Testbed, tmp_path: Path
) -> None:
    """The plan would advertise node1's private bridge address, but the store listens on every
    interface: a global IPv6 address on another NIC of node1 exposes it all the same."""
    testbed = clean_faults
    testbed.add_nic("node1", "pub0", "2a01:4f8:1:2::5/64")
    config = cluster(testbed, tmp_path, ["node1", "node2"])
    refused = herd(["launch", "-c", str(config), "--dry-run", "allreduce.py"], tmp_path, tmp_path)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "node1: the rendezvous store would listen on public address(es) 2a01:4f8:1:2::5" in (
        refused.stderr
    )
    assert "allow_public_rendezvous = true" in refused.stderr
    # The rendezvous on node2 (no public address): fine; and node1 allowed explicitly: fine.
    moved = cluster(testbed, tmp_path, ["node2", "node1"])
    ok = herd(["launch", "-c", str(moved), "--dry-run", "allreduce.py"], tmp_path, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    allowed = cluster(testbed, tmp_path, ["node1", "node2"], allow_public_rendezvous=True)
    # (--spares 1: node2, probed like the others, is a hot spare the plan leaves out.)
    argv = ["launch", "-c", str(allowed), "--spares", "1", "--dry-run", "allreduce.py"]
    ok = herd(argv, tmp_path, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "note: node2 is a hot spare: it takes no rank" in ok.stdout, ok.stdout
    assert "[node1] rendezvous host" in ok.stdout and "[node2]" not in ok.stdout, ok.stdout
    # An IPv4 public address counts the same way.
    testbed.remove_nic("node1", "pub0")
    testbed.add_nic("node1", "pub1", "11.22.33.44/24")
    config = cluster(testbed, tmp_path, ["node1", "node2"])
    refused = herd(["launch", "-c", str(config), "--dry-run", "allreduce.py"], tmp_path, tmp_path)
    assert refused.returncode == 3 and "11.22.33.44" in refused.stderr


def _ssh_config(testbed: Testbed, tmp_path: Path, strict: str | None) -> Path:
    """The testbed's ssh config with a fresh, empty known_hosts and the given setting."""
    known = tmp_path / "known_hosts"
    known.write_text("")
    text = testbed.ssh_config.read_text()
    text = re.sub(r"UserKnownHostsFile \S+", f"UserKnownHostsFile {known}", text)
    text = re.sub(
        r"\n\s*StrictHostKeyChecking \S+",
        f"\n    StrictHostKeyChecking {strict}" if strict else "",
        text,
    )
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return path


def test_a_strict_host_key_setting_of_the_user_is_kept(testbed: Testbed, tmp_path: Path) -> None:
    strict = _ssh_config(testbed, tmp_path, "yes")
    config = testbed.write_cluster_file(
        tmp_path / "herd.toml", nodes=["node1"], ssh_config=str(strict)
    )
    refused = herd(["exec", "-c", str(config), "--", "true"], tmp_path, tmp_path)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "host key not known" in refused.stdout + refused.stderr
    assert (tmp_path / "known_hosts").read_text() == ""  # nothing accepted behind their back
    # ssh's default (ask) under BatchMode: herd accepts a new key and records it.
    default = _ssh_config(testbed, tmp_path, None)
    config = testbed.write_cluster_file(
        tmp_path / "herd.toml", nodes=["node1"], ssh_config=str(default)
    )
    ok = herd(["exec", "-c", str(config), "--", "true"], tmp_path, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (tmp_path / "known_hosts").read_text().strip()


def test_job_files_are_private_on_the_launcher_and_the_nodes(
    testbed: Testbed, tmp_path: Path
) -> None:
    os.umask(0o022)  # the usual umask, which herd must not rely on
    config = cluster(testbed, tmp_path, ["node1", "node2"])
    home = tmp_path / "home"
    done = herd(["launch", "-c", str(config), "allreduce.py"], home, SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    [job] = list((home / "jobs").iterdir())
    for path in (home, home / "jobs", job):
        assert mode(path) == 0o700, path
    files = [p for p in job.iterdir() if p.is_file()]
    assert {p.name for p in files} >= {"job.json", "output.log", "rank-0.log", "rank-1.log"}
    assert all(mode(p) == 0o600 for p in files), {p.name: oct(mode(p)) for p in files}
    # The nodes (HERD_HOME from [cluster] env; the testbed's nodes share this filesystem).
    for node in ("node1", "node2"):
        node_dir = home / "nodes" / job.name / node
        for path in (home / "nodes", home / "nodes" / job.name, node_dir):
            assert mode(path) == 0o700, path
        assert mode(node_dir / "agent.json") == 0o600


def test_sync_never_copies_the_env_file(testbed: Testbed, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('train')\n")
    (src / ".env").write_text("HF_TOKEN=hf_synced_by_mistake\n")  # not in any .gitignore
    (src / ".env").chmod(0o600)
    dst = tmp_path / "dst"
    config = testbed.write_cluster_file(
        src / "herd.toml", nodes=["node1"], workdir=str(dst), env_file=".env"
    )
    done = herd(["sync", str(src), "-c", str(config)], tmp_path, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (dst / "train.py").exists()
    assert not (dst / ".env").exists()


@pytest.fixture
def home_python(testbed: Testbed) -> Iterator[str]:
    """``~/.herd-test-TAG/bin/python``: a wrapper that runs this suite's own interpreter. A
    symlink to a venv's python would start the base interpreter (no pyvenv.cfg beside the
    link), where torchherd is not installed on a fresh machine."""
    root = Path.home() / f".herd-test-{testbed.tag}"
    (root / "bin").mkdir(parents=True, exist_ok=True)
    try:
        wrapper = root / "bin" / "python"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        wrapper.chmod(0o755)
        # The wrapper really is an interpreter with this torchherd, as the nodes will run it.
        found = subprocess.run(
            [str(wrapper), "-c", "import torchherd; print(torchherd.__file__)"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert found.stdout.strip() == torchherd.__file__, found.stderr
        yield "~/" + str(wrapper.relative_to(Path.home()))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_home_relative_python_is_found_on_the_nodes(
    testbed: Testbed, tmp_path: Path, home_python: str
) -> None:
    config = cluster(testbed, tmp_path, ["node1", "node2"], python=home_python)
    plan = herd(["launch", "-c", str(config), "--dry-run", "allreduce.py"], tmp_path, SCRIPTS)
    # The probe ran with that interpreter on both nodes, and the plan keeps the ~ for them.
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert plan.stdout.count(f"'{home_python}' -m torchherd.agent.elastic") == 2, plan.stdout


def test_a_job_runs_with_a_home_relative_python(
    testbed: Testbed, tmp_path: Path, home_python: str
) -> None:
    config = cluster(testbed, tmp_path, ["node1", "node2"], python=home_python)
    done = herd(["launch", "-c", str(config), "allreduce.py"], tmp_path / "home", SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("RESULT") == 2 and "sum=3" in done.stdout, done.stdout
