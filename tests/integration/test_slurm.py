"""herd inside a real Slurm (Debian's slurmctld/slurmd/munge over the namespace testbed).

The batch script runs on the first node only; `herd launch` there must find the allocation,
start exactly one agent per node and run the job on all of them, asking slurmctld for one job
step across the allocation for the probe and one for the agents, not one per node.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import require_testbed
from tests.integration.test_launch import printed, results
from tests.integration.training import ARGS as TRAIN_ARGS
from tests.integration.training import losses
from tests.slurm_testbed import SlurmCluster, slurm_available
from tests.testbed import Testbed
from torchherd.errors import ConfigError
from torchherd.hostlist import expand_hostlist

# Its fixture is built once per module: xdist keeps the module's tests on one worker.
pytestmark = pytest.mark.xdist_group("slurm")

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


def run_batch(slurm: SlurmCluster, tmp_path: Path, body: str, *options: str) -> tuple[str, str]:
    """sbatch a job script of ``body`` with ``options`` and wait for its end: (its Slurm job
    id, its output), asserting that it completed."""
    output = tmp_path / "out.txt"
    script = job_script(tmp_path, body, *options, f"--output={output}")
    job = sbatch(slurm, script, tmp_path / "home")
    state = slurm.wait_job(job, timeout=300)
    text = output.read_text()
    assert state == "COMPLETED", text
    return job, text


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
    job, text = run_batch(
        slurm,
        tmp_path,
        f"exec {sys.executable} -m torchherd launch --nproc 1 allreduce.py",
        "--nodes=3",
        "--ntasks-per-node=1",
    )
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
    # One step for every agent, a task on every node, the agents answering the probe over
    # their links (one srun per node, and a probe of its own, would make six steps of one node).
    job = re.search(r"Granted job allocation (\d+)", done.stderr)
    assert job, done.stderr
    steps = slurm.steps_launched(job.group(1))
    assert list(steps.values()) == [{"node1", "node2", "node3"}], steps


def herd_cli(
    slurm: SlurmCluster, args: list[str], home: Path, cwd: Path = SCRIPTS
) -> subprocess.CompletedProcess[str]:
    return slurm.run([sys.executable, "-m", "torchherd", *args], cwd=cwd, env=herd_env(slurm, home))


def submitted_id(stdout: str) -> str:
    match = re.search(r"submitted slurm job (\d+)", stdout)
    assert match, stdout
    return match.group(1)


def test_herd_submit_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    home, output = tmp_path / "home", tmp_path / "submit.out"
    args = ["submit", "--scheduler", "slurm", "-N", "3", "--time", "00:10:00", "--grace", "60"]
    done = herd_cli(slurm, [*args, "-o", str(output), "allreduce.py"], home)
    assert done.returncode == 0, done.stderr
    job = submitted_id(done.stdout)
    assert f"squeue -j {job}" in done.stdout  # how to follow it
    script = Path(done.stdout.split("script: ")[1].split()[0]).read_text()
    assert "#SBATCH --signal=B:USR1@60" in script and "#SBATCH --requeue" in script
    assert "\nexec " in script  # herd is the batch shell process, so USR1 reaches it
    assert slurm.wait_job(job, timeout=300) == "COMPLETED", output.read_text()
    assert_three_ranks(output.read_text())
    listed = json.loads(herd_cli(slurm, ["ps", "--json"], home).stdout)
    mine = [row for row in listed if row.get("scheduler") == "slurm"]
    assert [(row["id"], row["state"]) for row in mine] == [(job, "COMPLETED")]


def submit_training(slurm: SlurmCluster, tmp_path: Path, name: str) -> tuple[str, Path, Path]:
    run_dir, output = tmp_path / name / "run", tmp_path / name / "out.txt"
    args = ["submit", "--scheduler", "slurm", "-N", "2", "--time", "00:10:00", "--grace", "60"]
    args += ["--max-requeues", "1", "-o", str(output), "slow_minimal.py", *TRAIN_ARGS]
    done = herd_cli(slurm, [*args, "--run-dir", str(run_dir)], tmp_path / name / "home")
    assert done.returncode == 0, done.stderr
    return submitted_id(done.stdout), run_dir, output


def test_time_limit_warning_saves_requeues_and_resumes(
    slurm: SlurmCluster, tmp_path: Path, uninterrupted_losses: list[tuple[int, float]]
) -> None:
    job, run_dir, output = submit_training(slurm, tmp_path, "warned")
    deadline = time.monotonic() + 180
    while not (run_dir / "snapshots" / "step-40").exists():
        assert time.monotonic() < deadline, "no snapshot in time: " + (
            output.read_text() if output.exists() else "(no output)"
        )
        time.sleep(0.1)
    # What Slurm does at --signal=B:USR1@60 before the time limit, now.
    warned = slurm.run(["scancel", "--signal=USR1", "--batch", job])
    assert warned.returncode == 0, warned.stderr
    assert slurm.wait_job(job, timeout=400) == "COMPLETED", output.read_text()
    text = output.read_text()
    assert "asking every worker to save a snapshot" in text, text
    assert f"requeued Slurm job {job} (requeue 1 of 1)" in text, text
    assert slurm.job_field(job, "Restarts") == "1"
    # The requeued run resumed from its snapshot (a run started again from step 0 would end at
    # the same final loss): once, from step 40 or later, and every step's loss is that of a
    # run never interrupted, each step logged once.
    resumed = re.findall(r"resumed from \S*/snapshots/step-(\d+)", text)
    assert len(resumed) == 1 and int(resumed[0]) >= 40, text
    assert losses(run_dir) == uninterrupted_losses


def test_exec_and_doctor_inside_an_allocation(slurm: SlurmCluster, tmp_path: Path) -> None:
    home = tmp_path / "home"
    for args in (["exec", "--", "hostname"], ["doctor"]):
        done = slurm.run(
            ["salloc", "--nodes=3", sys.executable, "-m", "torchherd", *args],
            cwd=SCRIPTS,
            env=herd_env(slurm, home),
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "herd: Slurm job" in done.stderr
        if args[0] == "exec":
            answers = sorted(line for line in done.stdout.splitlines() if " | " in line)
            assert answers == ["node1 | node1", "node2 | node2", "node3 | node3"], done.stdout
        else:
            assert "All 3 node(s) ready" in done.stdout, done.stdout
            assert "link(s) measured" in done.stdout  # the network tests ran through srun


def test_two_tasks_per_node_still_get_one_agent_per_node_in_one_step_after_the_setup(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """The allocation has 6 tasks (2 per node); herd starts one agent per node, all in one job
    step across the allocation (one task on each node), in the shell where [cluster] setup
    ran."""
    activate = tmp_path / "activate"
    activate.write_text("export FROM_SETUP=cluster-wide\necho activated\n")
    settings = tmp_path / "herd.toml"
    # The nodes come from Slurm; the file gives the settings (it must name a node).
    settings.write_text(f'[cluster]\nsetup = ". {activate}"\n\n[[node]]\nhost = "node1"\n')
    _, text = run_batch(
        slurm,
        tmp_path,
        f"exec {sys.executable} -m torchherd launch -c {settings} --nproc 1 where.py",
        "--nodes=3",
        "--ntasks-per-node=2",
    )
    found = printed(text, "WHERE")
    assert sorted(found) == [0, 1, 2], text  # world 3, not 6
    assert {f["world"] for f in found.values()} == {"3"}
    assert sorted(f["host"] for f in found.values()) == ["node1", "node2", "node3"]
    steps = {f["step"] for f in found.values()}
    assert len(steps) == 1 and "-" not in steps, found  # one job step for every node
    assert {(f["step_tasks"], f["step_nodes"]) for f in found.values()} == {("3", "3")}, found
    assert {f["setup"] for f in found.values()} == {"cluster-wide"}, found
    nothing_left(slurm, herd_job_id(text))


def test_sync_is_refused_inside_an_allocation_with_its_reason(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    done = slurm.run(
        ["salloc", "--nodes=2", sys.executable, "-m", "torchherd", "sync", str(project)],
        cwd=project,
        env=herd_env(slurm, tmp_path / "home"),
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "herd sync copies over ssh, and Slurm job" in done.stderr, done.stderr
    assert "starts its agents with srun" in done.stderr
    assert "fix: Slurm clusters share the filesystem" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "nodelist",
    [
        "node[1-3]",
        "gpu[01-04,07],cpu1",
        "n[098-101]",
        "a[1-2]x[3-4]",
        "node1 node2",
        "node[1-2] node3",
        "node[1-2],\nnode3",
    ],
)
def test_hostlists_expand_as_scontrol_does(slurm: SlurmCluster, nodelist: str) -> None:
    done = slurm.run(["scontrol", "show", "hostnames", nodelist])
    assert done.returncode == 0 and done.stdout.split(), done.stderr
    assert expand_hostlist(nodelist) == done.stdout.split()


def test_a_node_list_herd_cannot_read_is_expanded_by_scontrol(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """Slurm reads `node[1- 3]` (a space in a range); herd's own reader does not, so it asks
    `scontrol show hostnames`, and the command reaches all three nodes."""
    unreadable = "node[1- 3]"
    with pytest.raises(ConfigError):
        expand_hostlist(unreadable)
    done = slurm.run(
        ["salloc", "--nodes=3", "env", f"SLURM_JOB_NODELIST={unreadable}"]
        + [sys.executable, "-m", "torchherd", "exec", "--", "hostname"],
        cwd=SCRIPTS,
        env=herd_env(slurm, tmp_path / "home"),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SLURM_JOB_NODELIST): 3 node(s): node1, node2, node3" in done.stderr, done.stderr
    answers = sorted(line for line in done.stdout.splitlines() if " | " in line)
    assert answers == ["node1 | node1", "node2 | node2", "node3 | node3"], done.stdout
