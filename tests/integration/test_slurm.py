"""herd inside a real Slurm (Debian's slurmctld/slurmd/munge over the namespace testbed).

The batch script runs on the first node only; `herd launch` there must find the allocation,
start exactly one agent per node through srun and run the job on all of them.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import require_testbed
from tests.integration.test_launch import results
from tests.slurm_testbed import SlurmCluster, slurm_available
from tests.testbed import Testbed

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    require_testbed()
    ok, reason = slurm_available()
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"Slurm unavailable under CI: {reason}", pytrace=False)
        pytest.skip(reason)
    with Testbed(3, hosts_loopback=True) as bed, SlurmCluster(bed) as cluster:
        yield cluster


def herd_env(slurm: SlurmCluster, home: Path) -> dict[str, str]:
    return {"HERD_HOME": str(home), "PYTHONUNBUFFERED": "1"}


def job_script(tmp_path: Path, body: str, *options: str) -> Path:
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in options), f"cd {SCRIPTS}", body]
    path = tmp_path / "job.sh"
    path.write_text("\n".join(lines) + "\n")
    return path


def sbatch(slurm: SlurmCluster, script: Path, home: Path) -> str:
    done = slurm.run(["sbatch", "--parsable", str(script)], env=herd_env(slurm, home))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def nothing_left(slurm: SlurmCluster, job_id: str) -> None:
    deadline = time.monotonic() + 15
    left = slurm.bed.processes_with_env("HERD_JOB_ID", job_id)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = slurm.bed.processes_with_env("HERD_JOB_ID", job_id)
    assert not left, f"processes of herd job {job_id} still running: {left}"


def herd_job_id(output: str) -> str:
    match = re.search(r"herd \S+: job (\S+) on", output)
    assert match, output
    return match.group(1)


def assert_three_ranks(output: str) -> None:
    found = results(output)
    assert sorted(found) == [0, 1, 2], output
    assert {f["sum"] for f in found.values()} == {"6"}
    assert {f["world"] for f in found.values()} == {"3"}
    assert {f["host"] for f in found.values()} == {"node1", "node2", "node3"}
    for fields in found.values():
        assert fields["prefix_host"] == fields["host"]  # merged output names each node


def test_sbatch_runs_herd_launch_on_every_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    output = tmp_path / "out.txt"
    script = job_script(
        tmp_path,
        f"exec {sys.executable} -m torchherd launch --nproc 1 allreduce.py",
        "--nodes=3",
        "--ntasks-per-node=1",
        f"--output={output}",
    )
    job = sbatch(slurm, script, tmp_path / "home")
    state = slurm.wait_job(job, timeout=300)
    text = output.read_text()
    assert state == "COMPLETED", text
    assert f"herd: Slurm job {job} (from SLURM_JOB_ID, SLURM_JOB_NODELIST)" in text
    assert_three_ranks(text)
    nothing_left(slurm, herd_job_id(text))


def test_salloc_interactive_run(slurm: SlurmCluster, tmp_path: Path) -> None:
    # salloc runs the command here, outside the nodes (a login node): srun reaches them.
    done = slurm.run(
        [
            "salloc",
            "--nodes=3",
            "--ntasks-per-node=1",
            sys.executable,
            "-m",
            "torchherd",
            "launch",
            "--nproc",
            "1",
            "allreduce.py",
        ],
        cwd=SCRIPTS,
        env=herd_env(slurm, tmp_path / "home"),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "herd: Slurm job" in done.stderr
    assert_three_ranks(done.stdout)
    nothing_left(slurm, herd_job_id(done.stdout))
