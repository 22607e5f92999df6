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
        (["launch", "--group-nodes", "2", "train.py"], "--group-nodes goes with --replica-groups"),
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


def test_replica_groups_that_do_not_split_the_nodes_are_refused_before_any_node_is_touched(
    capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))
    (tmp_path / "train.py").write_text("print('trained')\n")
    # Three hosts that do not exist: the refusal must come before any connection.
    argv = ["launch", "-H", "nohost-a,nohost-b,nohost-c", "--replica-groups"]
    code = main([*argv, "--group-nodes", "2", "train.py"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the job's 3 node(s) do not split into replica groups of 2" in err, err
    assert "use a --group-nodes that divides 3" in err and "Traceback" not in err


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
        "print([m for m in ('torchherd.launcher.launch', 'torchherd.launcher.job', "
        "'torchherd.preflight', 'torchherd.spec', 'pydantic', 'torch') if m in sys.modules])"
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


@pytest.mark.parametrize("argv", [["launch", "--help"], ["doctor", "--help"], ["report", "--help"]])
def test_help_at_80_columns_is_wrapped_once(argv: list[str], tmp_path) -> None:
    """A docstring's own line breaks are not kept: at 80 columns a line of a command's
    description that its paragraph goes on after is nearly full, never an orphan word."""
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "torchherd", *argv],
        cwd=tmp_path,
        env=dict(os.environ, COLUMNS="80", HERD_HOME=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    text = [
        line.strip()
        for line in run.stdout.splitlines()
        if not line.lstrip().startswith(("│", "╭", "╰", "Usage:"))
    ]
    for line, following in zip(text, text[1:], strict=False):
        if line and following and not following.startswith(("-", "*")):
            assert len(line) >= 50, f"an orphan line {line!r} before {following!r}"


def test_every_commands_help_is_unwrapped() -> None:
    """What --help shows of each command (the root's list too) has no line break inside a
    paragraph but before a list item."""
    import typer.main

    from torchherd.cli.dispatch import app, register_commands

    register_commands()  # every command, not only those an earlier test ran

    root = typer.main.get_command(app)
    groups = [root, *(c for c in root.commands.values() if hasattr(c, "commands"))]
    commands = [c for g in groups for c in g.commands.values()]
    for command in commands:
        for paragraph in (command.help or "").split("\n\n"):
            for line in paragraph.splitlines()[1:]:
                assert line.startswith(("- ", "* ", "  ")), (command.name, paragraph)
