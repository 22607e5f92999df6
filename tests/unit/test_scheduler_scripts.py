"""Job scripts of `herd submit`, time limits, and the requeue bound (no scheduler needed)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest

from torchherd.cli import main
from torchherd.errors import UsageError
from torchherd.scheduler.render import SubmitSpec, render, time_seconds
from torchherd.scheduler.requeue import requeue_after_save
from torchherd.spec import ClusterSpec, NodeSpec


def spec(scheduler: str, **fields: object) -> SubmitSpec:
    base: dict[str, object] = {
        "scheduler": scheduler,
        "nodes": 4,
        "launch_args": ("train.py", "--lr", "3e-4"),
        "herd": ("/venv/bin/python", "-m", "torchherd"),
        "workdir": "/home/me/my project",
        "time": "02:00:00",
        "gpus_per_node": 8,
    }
    base.update(fields)
    return SubmitSpec(**base)  # type: ignore[arg-type]


def test_slurm_script() -> None:
    text = render(spec("slurm", partition="gpu", account="proj", grace=90))
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in (
        "--nodes=4",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--time=02:00:00",
        "--partition=gpu",
        "--account=proj",
        "--signal=B:USR1@90",
        "--requeue",
    ):
        assert f"#SBATCH {option}" in lines
    assert "cd '/home/me/my project'" in lines
    assert lines[-1] == (
        "exec /venv/bin/python -m torchherd launch --max-requeues=3 --time-grace=90 "
        "train.py --lr 3e-4"
    )


def test_slurm_keeps_the_allocation_when_herd_handles_node_loss() -> None:
    """With --min-nodes herd goes on without a lost node: Slurm must not end the job first."""
    handled = render(spec("slurm", launch_args=("--min-nodes", "2", "train.py")))
    assert "#SBATCH --no-kill" in handled.splitlines()
    assert "herd goes on without the node" in handled
    spared = render(spec("slurm", launch_args=("--spares=1", "train.py")))
    assert "#SBATCH --no-kill" in spared.splitlines() and "puts a spare in its place" in spared
    plain = render(spec("slurm"))
    assert "--no-kill" not in plain and "Slurm ends the job and requeues it" in plain


def test_the_save_window_is_the_warning_less_the_stop() -> None:
    from torchherd.cli.launch import save_window

    assert save_window(120, 10) == 100  # Slurm's 120 s warning, a 10 s grace, a 10 s margin
    assert save_window(20, 10) == 5  # never under 5 s


def test_pbs_script() -> None:
    text = render(spec("pbs", cpus_per_node=64, gpu_resource="ngpus", partition="workq"))
    lines = text.splitlines()
    for line in (
        "#PBS -l select=4:ncpus=64:mpiprocs=1:ngpus=8",
        "#PBS -l place=scatter",
        "#PBS -l walltime=02:00:00",
        "#PBS -q workq",
        "#PBS -r y",
    ):
        assert line in lines
    assert lines[-1].startswith("exec /venv/bin/python -m torchherd launch --max-requeues=3")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 5400), ("1:30:00", 5400), ("00:10:00", 600), ("2-00:00:00", 172800), ("5:30", 330)],
)
def test_time_limits(text: str, seconds: int) -> None:
    assert time_seconds(text) == seconds


def test_bad_time_and_grace() -> None:
    with pytest.raises(UsageError, match="cannot read the time limit"):
        time_seconds("two hours")
    with pytest.raises(UsageError, match="grace"):
        render(spec("slurm", time="00:01:00", grace=120))


def test_submit_dry_run_prints_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["submit", "--scheduler", "slurm", "-N", "2", "--dry-run", "train.py", "-x"])
    out = capsys.readouterr().out
    assert code == 0
    assert "#SBATCH --nodes=2" in out and out.rstrip().endswith("train.py -x")
    assert main(["submit", "--scheduler", "lsf", "-N", "2", "train.py"]) == 2


def _cluster(transport: str, job: str | None = "42") -> ClusterSpec:
    return ClusterSpec(
        nodes=(NodeSpec(host="n1"),),
        transport=transport,  # type: ignore[arg-type]
        scheduler_job_id=job,
    )


def test_requeues_are_bounded() -> None:
    calls: list[Sequence[str]] = []

    def never(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    said = requeue_after_save(_cluster("slurm"), 2, {"SLURM_RESTART_COUNT": "2"}, never)
    assert "not requeued: 2 requeue(s) done, --max-requeues is 2" in said
    said = requeue_after_save(_cluster("pbs"), 1, {"HERD_REQUEUE_COUNT": "1"}, never)
    assert "not requeued" in said
    said = requeue_after_save(_cluster("ssh", None), 5, {}, never)
    assert "run the same command again" in said
    assert calls == []
