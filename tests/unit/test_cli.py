"""The herd command line itself: usage mistakes are one message and exit 2, never a traceback."""

from __future__ import annotations

import pytest

from torchherd import __version__
from torchherd.cli import main


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["launch", "--nproc", "0", "train.py"], "--nproc"),
        (["launch", "--max-restarts", "many", "train.py"], "--max-restarts"),
        (["bogus"], "herd has no command 'bogus'"),
        (["launch", "--detach", "--max-restarts", "1", "train.py"], "needs an attached launcher"),
        (["launch", "train.py", "--epochs", "3"], "training script train.py not found"),
    ],
)
def test_usage_mistakes_exit_2_without_traceback(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no herd.toml here, and no train.py
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert fragment in err
    assert "Traceback" not in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in (
        "launch",
        "doctor",
        "init",
        "ssh-setup",
        "exec",
        "sync",
        "ps",
        "logs",
        "stop",
        "top",
        "demo",
    ):
        assert command in out


def test_help_imports_neither_the_launcher_nor_the_doctor_nor_pydantic(tmp_path) -> None:
    """Every command pays for what dispatch imports: `herd --help` needs none of these."""
    import os
    import subprocess
    import sys

    probe = (
        "import sys; from torchherd.cli import main; main(['--help']); "
        "print([m for m in ('torchherd.launch', 'torchherd.job', 'torchherd.preflight', "
        "'torchherd.spec', 'pydantic', 'torch') if m in sys.modules])"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=dict(os.environ, HERD_HOME=str(tmp_path / "home")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout[-500:]


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (["run", "train.py"], "did you mean `herd launch`?"),
        (["status"], "did you mean `herd ps`?"),
        (["lanch", "train.py"], "did you mean `herd launch`?"),
        (["bench", "nett"], "did you mean `herd bench net`?"),
        (["--verison"], "did you mean --version? (herd -h lists every option)"),
    ],
)
def test_a_mistyped_or_borrowed_name_gets_a_suggestion(
    argv: list[str], fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"fix: {fix}" in err, err
    assert "options for" not in err  # herd itself runs no script: no word about one
    assert "Traceback" not in err
