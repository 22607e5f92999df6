"""The slow node, named while the job runs: a testbed node's worker held to a fraction of a
CPU by a real cgroup quota is named, with the likely cause, within two minutes; the same job
balanced names nobody over as long."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.integration.herd_cli import SCRIPTS
from tests.integration.live import LiveHerd, pids
from tests.testbed import Testbed

BALANCED_FOR = 120.0


def cpu_cgroup() -> Path:
    name = f"herd-test-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    for root in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct")):
        if (root / "cpu.cfs_quota_us").exists():
            return root / name
    return Path("/sys/fs/cgroup") / name


def hold_to(group: Path, pid: int, share: float) -> None:
    group.mkdir()
    if (group / "cpu.cfs_quota_us").exists():
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(share * 100000)))
    else:
        (group / "cpu.max").write_text(f"{int(share * 100000)} 100000")
    (group / "cgroup.procs").write_text(str(pid))


def release(group: Path) -> None:
    if not group.exists():
        return
    parent_procs = group.parent / "cgroup.procs"
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            parent_procs.write_text(pid)
        except OSError:
            pass
    group.rmdir()


def test_a_throttled_node_is_named_and_a_balanced_job_is_not(
    testbed: Testbed, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[{"host": "node1", "nproc": 1}, {"host": "node2", "nproc": 1}],
        workdir=str(SCRIPTS),
        # One core per worker: on this two-core machine the balanced job is balanced.
        env={"HERD_HOME": str(home), "OMP_NUM_THREADS": "1"},
    )
    run_dir = str(tmp_path / "run")
    herd = LiveHerd(["-c", str(path), "heavy.py", "--run-dir", run_dir], home, testbed)
    group = cpu_cgroup()
    try:
        found = herd.wait_for(r"HEAVY rank=(?P<rank>\d) pid=(?P<pid>\d+)", 180, count=2)
        victim = pids(next(m for m in found if m.group("rank") == "1"))
        time.sleep(BALANCED_FOR)
        assert "slow rank" not in herd.output, herd.output  # balanced: nobody named
        hold_to(group, victim, 0.3)
        # Named in about a minute alone (the slow window refilled, then six checks in a row);
        # once, in a full CI run, not within 120 s: the bound keeps a loaded machine's margin.
        named = herd.wait_for(r"herd: slow rank: (node\S+ rank \d+ .*)", 210)[0]
        line = named.group(1)
        assert line.startswith("node2 rank 1 is "), line
        ratio = float(re.search(r"is (\d+\.\d)x slower", line).group(1))  # type: ignore[union-attr]
        assert ratio >= 1.3, line
        assert "likely: CPU throttled by its cgroup (quota 30% of a CPU)" in line, line
        top = subprocess.run(
            [sys.executable, "-m", "torchherd", "top", "--once", "-c", str(path)],
            env=dict(os.environ, HERD_HOME=str(home)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "slow rank: node2 rank 1" in top.stdout, top.stdout + top.stderr
        herd.signal(signal.SIGINT)
        code = herd.finish(timeout=120)
    finally:
        release(group)
        if herd.process.poll() is None:
            herd.process.kill()
    assert code == 130, herd.output
    record = herd.record()
    assert record["slow"].startswith("node2 rank 1"), record
    assert record["attempts"][-1]["slow"] == [record["slow"]]
    herd.assert_clean(["node1", "node2"])
