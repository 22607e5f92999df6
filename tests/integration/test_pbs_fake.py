"""herd inside a FAKE PBS allocation (tests/fake_pbs: no PBS can run here, so this is a fake
that reproduces a real allocation's behaviour) on the namespace testbed.

The batch script runs on the first node only, with a nodefile listing every host twice
(mpiprocs=2) under fully qualified names; `herd launch` there must start one agent per host (over
ssh, attached to the job with pbs_attach), see failures on other nodes (pbsdsh's exit 0 is not
trusted: herd does not use it), render PBS job scripts right, and chain a job at the walltime.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from tests.fake_pbs.allocation import BIN, DOMAIN, FakePbsAllocation
from tests.integration.test_launch import results
from tests.integration.training import losses
from tests.testbed import Testbed

SCRIPTS = Path(__file__).parent / "scripts"


def allocation(testbed: Testbed, tmp_path: Path) -> tuple[FakePbsAllocation, Path]:
    fake = FakePbsAllocation(testbed, tmp_path / "fake-pbs", mpiprocs=2)
    settings = fake.settings(tmp_path / "herd.toml", env={"HERD_HOME": str(tmp_path / "home")})
    return fake, settings


def test_fake_pbs_launch_reaches_every_node_once(testbed: Testbed, tmp_path: Path) -> None:
    fake, settings = allocation(testbed, tmp_path)
    done = fake.herd(
        ["launch", "-c", str(settings), "--nproc", "1", "allreduce.py"],
        cwd=SCRIPTS,
        HERD_HOME=str(tmp_path / "home"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"herd: PBS job {fake.job_id} (from PBS_JOBID, PBS_NODEFILE): 4 node(s)" in done.stderr
    found = results(done.stdout)
    assert sorted(found) == [0, 1, 2, 3], done.stdout  # one agent per host, not per line
    assert {f["sum"] for f in found.values()} == {"10"}
    assert {f["host"] for f in found.values()} == {n.name for n in testbed.nodes}
    assert {f["prefix_host"] for f in found.values()} == {
        f"{n.name}.{DOMAIN}" for n in testbed.nodes
    }
    # Every agent ran attached to the job, on its own node (probe + agent on each host).
    attached = fake.calls("pbs_attach")
    assert {c["host"] for c in attached} == {n.name for n in testbed.nodes}
    assert all(c["argv"][:2] == ["-j", fake.job_id] for c in attached)
    assert not fake.calls("pbsdsh")


def test_fake_pbs_failure_on_another_node_is_seen(testbed: Testbed, tmp_path: Path) -> None:
    fake, settings = allocation(testbed, tmp_path)
    done = fake.herd(
        ["launch", "-c", str(settings), "--nproc", "1", "allreduce.py", "--fail-rank", "3"],
        cwd=SCRIPTS,
        HERD_HOME=str(tmp_path / "home"),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "rank 3 failing on purpose" in done.stdout
    summary = done.stdout[done.stdout.rfind("failed") :]
    assert "rank 3" in summary, done.stdout


def test_fake_pbsdsh_behaves_like_the_real_one(testbed: Testbed, tmp_path: Path) -> None:
    """Why herd does not use pbsdsh: one task per nodefile line, a stripped environment in
    $HOME, and exit 0 although every task failed (checked on this FAKE's pbsdsh)."""
    fake, _ = allocation(testbed, tmp_path)
    done = fake.run(
        ["pbsdsh", "--", "sh", "-c", 'echo "task $(hostname) $PWD ${VIRTUAL_ENV:-none}"; exit 3'],
        cwd=SCRIPTS,
        VIRTUAL_ENV="/venv",
    )
    assert done.returncode == 0
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("task"))
    assert len(lines) == 2 * len(testbed.nodes)
    assert all(line.endswith(" /root none") for line in lines), lines


def test_fake_pbs_submit_renders_and_chains(testbed: Testbed, tmp_path: Path) -> None:
    fake, settings = allocation(testbed, tmp_path)
    home = str(tmp_path / "home")
    args = ["submit", "--scheduler", "pbs", "-N", "2", "-G", "4", "--cpus-per-node", "64"]
    args += ["--time", "02:00:00", "-q", "gpu", "-A", "proj", "--gpu-resource", "gpus"]
    done = fake.herd([*args, "train.py", "--epochs", "3"], cwd=tmp_path, HERD_HOME=home)
    assert done.returncode == 0, done.stderr
    (call,) = fake.calls("qsub")
    script = call["script"]
    for line in (
        "#PBS -l select=2:ncpus=64:mpiprocs=1:gpus=4",
        "#PBS -l place=scatter",
        "#PBS -l walltime=02:00:00",
        "#PBS -q gpu",
        "#PBS -A proj",
        "#PBS -r y",
        f"cd {tmp_path}",
        f"export HERD_JOB_SCRIPT={call['argv'][-1]}",
    ):
        assert line in script.splitlines(), script
    assert script.rstrip().endswith("--max-requeues=3 --time-grace=120 train.py --epochs 3")
    assert f"submitted pbs job {call['job_id']}" in done.stdout
    listed = json.loads(fake.herd(["ps", "--json"], cwd=tmp_path, HERD_HOME=home).stdout)
    assert [(r["id"], r["state"]) for r in listed if r.get("scheduler")] == [
        (call["job_id"], "QUEUED")
    ]
    # PBS forgets a job some time after it ended: qstat no longer knows it (exit 153). herd
    # cannot tell how it ended, and says so.
    jobs = json.loads((fake.dir / "jobs.json").read_text())
    del jobs[call["job_id"]]
    (fake.dir / "jobs.json").write_text(json.dumps(jobs))
    listed = json.loads(fake.herd(["ps", "--json"], cwd=tmp_path, HERD_HOME=home).stdout)
    assert [(r["id"], r["state"]) for r in listed if r.get("scheduler")] == [
        (call["job_id"], "unknown")
    ]
    table = fake.herd(["ps"], cwd=tmp_path, HERD_HOME=home).stdout
    assert any(call["job_id"] in line and "unknown" in line for line in table.splitlines())


def test_fake_pbs_walltime_saves_and_the_chained_job_resumes(
    testbed: Testbed, tmp_path: Path
) -> None:
    fake, settings = allocation(testbed, tmp_path)
    # qstat says 3 minutes of walltime are left; with a grace of 160 s herd warns itself
    # after 20 s, mid-training (1,000 steps of at least 20 ms cannot be done by then).
    fake.set_walltime("00:03:00", "00:00:00")
    run_dir = tmp_path / "run"
    script = tmp_path / "job.pbs"
    herd_launch = [
        sys.executable,
        "-m",
        "torchherd",
        "launch",
        "-c",
        str(settings),
        "--nproc",
        "1",
        "--max-requeues",
        "2",
        "--time-grace",
        "160",
        "slow_minimal.py",
        "--max-steps",
        "1000",
        "--snapshot-every",
        "20",
        "--batch-size",
        "16",
        "--run-dir",
        str(run_dir),
    ]
    script.write_text(
        "#!/bin/bash\n"
        f"export HERD_JOB_SCRIPT={script}\n"  # as `herd submit` writes it
        f"cd {SCRIPTS}\n"
        f"exec {shlex.join(herd_launch)}\n"
    )
    home = str(tmp_path / "home")
    done = fake.run(["bash", str(script)], cwd=tmp_path, HERD_HOME=home, HERD_REQUEUE_COUNT="1")
    assert done.returncode == 5, done.stdout + done.stderr
    assert "asking every worker to save a snapshot" in done.stdout
    (call,) = fake.calls("qsub")
    assert call["argv"] == [
        "-W",
        f"depend=afterany:{fake.job_id}",
        "-v",
        "HERD_REQUEUE_COUNT=2",
        str(script),
    ]
    assert f"to run after PBS job {fake.job_id} (requeue 2 of 2)" in done.stderr
    saved = int((run_dir / "snapshots" / "latest").read_text().strip().removeprefix("step-"))
    assert 0 < saved < 1000

    # What PBS does once the first job has ended: the chained job starts in a new allocation
    # with the variables qsub was given (-v), and runs the script as it was submitted.
    chained = FakePbsAllocation(testbed, fake.dir, mpiprocs=2, job_id=call["job_id"])
    rerun = chained.run(
        ["bash", "-c", call["script"]], cwd=tmp_path, HERD_HOME=home, HERD_REQUEUE_COUNT="2"
    )
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"resumed from {run_dir / 'snapshots'}/step-{saved} " in rerun.stdout, rerun.stdout
    # Every step is in metrics.jsonl once or, where the first job went past its snapshot
    # before it stopped, redone after it; none was started over from step 1.
    steps = [step for step, _ in losses(run_dir)]
    assert steps[-1] == 1000 and steps.count(1) == 1, steps[:5]
    assert sorted(set(steps)) == list(range(1, 1001))
    second = len(steps) - (1000 - saved)
    assert steps[second:] == list(range(saved + 1, 1001))


def test_fake_pbs_exec_and_doctor_inside_the_allocation(testbed: Testbed, tmp_path: Path) -> None:
    fake, settings = allocation(testbed, tmp_path)
    done = fake.herd(["exec", "-c", str(settings), "--", "hostname"], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"herd: PBS job {fake.job_id}" in done.stderr
    answers = sorted(line.split() for line in done.stdout.splitlines() if " | " in line)
    assert answers == [[f"{n.name}.{DOMAIN}", "|", n.name] for n in testbed.nodes], done.stdout
    done = fake.herd(["doctor", "-c", str(settings)], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"All {len(testbed.nodes)} node(s) ready" in done.stdout, done.stdout
    assert "link(s) measured" in done.stdout  # the network tests ran between the nodes


def test_fake_pbs_setup_prelude_runs_before_every_agent(testbed: Testbed, tmp_path: Path) -> None:
    fake = FakePbsAllocation(testbed, tmp_path / "fake-pbs", mpiprocs=2)
    activate = tmp_path / "activate"
    activate.write_text("export FROM_SETUP=cluster-wide\necho activated\n")
    (tmp_path / "job.py").write_text(
        "import os\nprint('SEEN', os.environ['HERD_NODE'], os.environ.get('FROM_SETUP'))\n"
    )
    settings = fake.settings(
        tmp_path / "herd.toml", env={"HERD_HOME": str(tmp_path / "home")}, setup=f". {activate}"
    )
    done = fake.herd(
        ["launch", "-c", str(settings), "--nproc", "1", "job.py"],
        cwd=tmp_path,
        HERD_HOME=str(tmp_path / "home"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = sorted(line.split("SEEN ", 1)[1] for line in done.stdout.splitlines() if "SEEN" in line)
    assert seen == [f"{n.name}.{DOMAIN} cluster-wide" for n in testbed.nodes], done.stdout


def test_fake_pbs_sync_reaches_every_host_once(testbed: Testbed, tmp_path: Path) -> None:
    fake, settings = allocation(testbed, tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('hi')\n")
    done = fake.herd(["sync", "-c", str(settings), str(project)], cwd=project)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split()[0] for line in done.stdout.splitlines() if DOMAIN in line]
    assert rows == [f"{n.name}.{DOMAIN}" for n in testbed.nodes]  # once each, not per line
    # The testbed's nodes share this filesystem, as HPC nodes usually do: nothing to copy.
    assert all("shared filesystem" in line for line in done.stdout.splitlines() if DOMAIN in line)


def without_qstat(fake: FakePbsAllocation, tmp_path: Path) -> str:
    """A PATH for the job where the FAKE PBS commands are, but qstat is not (a compute node
    without the PBS client tools, or a job script that did not load them)."""
    bin_dir = tmp_path / "pbs-bin-without-qstat"
    bin_dir.mkdir()
    for tool in BIN.iterdir():
        if tool.name != "qstat":
            (bin_dir / tool.name).symlink_to(tool)
    rest = [d for d in fake.env()["PATH"].split(os.pathsep) if d != str(BIN)]
    assert not any((Path(d) / "qstat").exists() for d in rest), "a qstat outside the fake"
    return os.pathsep.join([str(bin_dir), *rest])


def test_fake_pbs_launch_without_qstat_runs_and_says_no_walltime_save_is_armed(
    testbed: Testbed, tmp_path: Path
) -> None:
    fake, settings = allocation(testbed, tmp_path)
    done = fake.herd(
        ["launch", "-c", str(settings), "--nproc", "1", "allreduce.py"],
        cwd=SCRIPTS,
        HERD_HOME=str(tmp_path / "home"),
        PATH=without_qstat(fake, tmp_path),
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"the walltime of PBS job {fake.job_id} is unknown (qstat is not on PATH)" in (
        done.stderr
    ), done.stderr
    assert "no snapshot is asked for before the walltime" in done.stderr
    assert sorted(results(done.stdout)) == [0, 1, 2, 3]
    assert fake.calls("pbs_attach")  # the rest of the fake was there and used
