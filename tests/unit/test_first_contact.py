"""What a newcomer with torchrun's habits types first: options before the script are herd's
(mistyped ones named, torchrun's spellings read), one host vocabulary on every command,
``--debug`` anywhere, help that shows flags as flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchherd.cli import main
from torchherd.cli.state import state


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty project directory (no herd.toml) with a train.py in it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))
    (tmp_path / "train.py").write_text("print('hello')\n")
    return tmp_path


@pytest.mark.parametrize(
    ("typed", "said", "fix"),
    [
        (["--nprocs", "2"], "herd launch has no option --nprocs", "did you mean --nproc?"),
        (["--dryrun"], "herd launch has no option --dryrun", "did you mean --dry-run?"),
        (["--max-restart", "1"], "no option --max-restart", "did you mean --max-restarts?"),
        (["--standalone", "-H", "gpu1"], "--standalone is torchrun's option", "drop --standalone"),
        (["--nnodes", "2"], "--nnodes is torchrun's option", "--min-nodes"),
        (["--nnodes=1:4"], "--nnodes is torchrun's option", "--min-nodes"),
        (["--node_rank", "1"], "--node_rank is torchrun's option", "run herd once"),
        (["--rdzv-endpoint", "x:29500"], "herd chooses the rendezvous", "rdzv_port"),
        (["--tee", "3"], "--tee is torchrun's option", "--ranks"),
    ],
)
def test_options_before_the_script_are_never_taken_for_the_script(
    here: Path, typed: list[str], said: str, fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["launch", *typed, "train.py"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert said in err, err
    assert fix in err, err
    assert "not found" not in err  # never "training script --nprocs not found"
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "spelling",
    [
        ["--nproc-per-node", "3"],
        ["--nproc_per_node=3"],
        ["--nproc-per-node=3"],
        ["--nproc", "3"],
    ],
)
def test_torchruns_spellings_of_nproc_are_herds(
    here: Path, spelling: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *spelling, "--max_restarts", "1", "--dry-run", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "world size 3" in out and "--nproc-per-node=3" in out


def test_what_follows_the_script_or_module_is_theirs(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The script's own options, even ones herd also has, and even --debug, are the script's.
    assert main(["launch", "--dry-run", "train.py", "--nprocs", "2", "--debug", "--dry-run"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("train.py --nprocs 2 --debug --dry-run")
    assert state.debug is False
    # -m MODULE ends herd's options as a script does: --indent belongs to json.tool.
    assert main(["launch", "--dry-run", "-m", "json.tool", "--indent", "2"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("--module json.tool --indent 2")
    assert main(["launch", "--dry-run", "--module=json.tool", "--sort-keys"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("--module json.tool --sort-keys")


@pytest.mark.parametrize(
    ("argv", "said", "fix"),
    [
        (["exec", "--jsn", "--", "echo", "hi"], "herd exec has no option --jsn", "--json"),
        (["exec", "--node", "gpu1", "--", "true"], "herd exec has no option --node", "--nodes"),
        (["sync", "--exlude", "x"], "herd sync has no option --exlude", "--exclude"),
    ],
)
def test_a_mistyped_exec_option_is_not_run_as_the_command(
    here: Path, argv: list[str], said: str, fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert said in captured.err and f"did you mean {fix}?" in captured.err
    assert "Illegal option" not in captured.out + captured.err


def test_exec_takes_hosts_like_launch(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # -H was run by the local shell as the command ("sh: 0: Illegal option --"); now it names
    # the node to reach (an address nothing listens on: unreachable, exit 3).
    code = main(["exec", "-H", "192.0.2.1", "--timeout", "5", "--", "true"])
    captured = capsys.readouterr()
    assert code == 3, captured
    assert "Illegal option" not in captured.out + captured.err
    assert "192.0.2.1" in captured.out


NODE_COMMANDS = [
    ["launch"],
    ["doctor"],
    ["exec"],
    ["sync"],
    ["top"],
    ["ssh-setup"],
    ["bench", "net"],
    ["bench", "allreduce"],
    ["bench", "scaling"],
    ["bench", "all"],
]


@pytest.mark.parametrize("command", NODE_COMMANDS, ids=" ".join)
def test_one_host_vocabulary_and_debug_on_every_command(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # --debug after the command is accepted (it was "No such option" everywhere but first).
    assert main([*command, "--debug", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--config", "--hosts", "-H", "--nodes"):
        assert f" {option} " in out, f"herd {' '.join(command)} lacks {option}"
    assert "<bool>" not in out  # flags take no value


def test_debug_after_the_command_shows_tracebacks(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(Exception, match="no job"):
        main(["logs", "nosuchjob", "--debug"])
    assert main(["logs", "nosuchjob"]) == 2
    assert "error: no job 'nosuchjob'" in capsys.readouterr().err


def test_a_plan_with_more_cpu_workers_than_cores_says_so(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    many = (os.cpu_count() or 1) + 62
    assert main(["launch", "--nproc", str(many), "--dry-run", "train.py"]) == 0
    out = capsys.readouterr().out
    assert f"warning: localhost: {many} workers on {os.cpu_count()} CPU core(s)" in out
    assert f"fix: --nproc {os.cpu_count()} (or fewer)" in out


@pytest.mark.parametrize(
    ("typed", "fragment"),
    [
        (["--env", "NOEQUALS"], "--env 'NOEQUALS' is not KEY=VALUE"),
        (["--env", "1X=2"], "is not KEY=VALUE"),
        (["--ranks", "3-1"], "--ranks '3-1'"),
        (["--ranks", "zero"], "--ranks 'zero'"),
        (["--name", "a/b"], "--name 'a/b'"),
        (["--name", "x\ny"], "a job name is"),
        (["-m", "json.tool", "--no-python"], None),  # --no-python is json.tool's here
        (["--no-python", "-m", "json.tool"], "-m and --no-python"),
    ],
)
def test_new_launch_options_refuse_bad_values(
    here: Path, typed: list[str], fragment: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["launch", "--dry-run", *typed, *([] if "-m" in typed else ["train.py"])])
    err = capsys.readouterr().err
    if fragment is None:
        assert code == 0, err
        return
    assert code == 2, err
    assert fragment in err and "Traceback" not in err


def test_env_and_name_reach_the_workers_environment(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["launch", "--dry-run", "--env", "NCCL_DEBUG=INFO", "-e", "OMP_NUM_THREADS=7"]
    assert main([*argv, "--name", "exp-1", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "env:       NCCL_DEBUG=INFO" in out
    assert "env:       OMP_NUM_THREADS=7" in out  # the user's value wins over herd's share
    assert "env:       HERD_JOB_NAME=exp-1" in out


def test_no_python_runs_a_program(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--dry-run", "--no-python", "echo", "hi"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("--tee=3 --no-python echo hi")
    # A program that is nowhere is a preflight failure naming it, before anything starts.
    assert main(["launch", "--dry-run", "--no-python", "no-such-program-here"]) == 3
    assert "program no-such-program-here not found on the PATH" in capsys.readouterr().err
    script = here / "run.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    assert main(["launch", "--dry-run", "--no-python", "./run.sh"]) == 3  # not executable
    assert "chmod +x" in capsys.readouterr().err
    script.chmod(0o755)
    assert main(["launch", "--dry-run", "--no-python", "./run.sh"]) == 0


def test_a_missing_module_on_this_machine_is_not_fixed_by_herd_sync(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", "--dry-run", "-m", "no_such_package.train"]) == 3
    err = capsys.readouterr().err
    assert "module no_such_package.train is not importable" in err
    assert "herd sync" not in err  # herd sync refuses on one machine
    assert "run herd from the directory that holds no_such_package" in err
