"""What `herd launch` makes of a command line typed in a hurry: an empty -H (an unset shell
variable) is refused rather than run on this machine; torchrun's --standalone and --nnodes 1
mean what herd does with no cluster and are taken there; a dry run refuses the --log-dir the
launch would."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchherd.cli import main


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HERD_HOME", str(tmp_path / "home"))
    (tmp_path / "train.py").write_text("print('hello')\n")
    return tmp_path


@pytest.mark.parametrize("hosts", ["", " ", ","])
def test_an_empty_host_list_is_refused_not_run_here(
    here: Path, hosts: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["launch", "-H", hosts, "train.py"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "-H is empty" in err and "Traceback" not in err


@pytest.mark.parametrize("typed", [["--standalone"], ["--nnodes", "1"], ["--nnodes=1"]])
def test_torchruns_single_node_options_are_taken_with_no_cluster(
    here: Path, typed: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *typed, "--dry-run", "train.py", "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("train.py --epochs 1")


@pytest.mark.parametrize("typed", [["--standalone"], ["--nnodes", "1"]])
def test_torchruns_single_node_options_are_refused_with_other_nodes(
    here: Path, typed: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["launch", *typed, "-H", "gpu1,gpu2", "--dry-run", "train.py"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "is torchrun's option" in err and "-H" in err


def test_a_dry_run_refuses_the_log_dir_the_launch_refuses(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["launch", "--dry-run", "--log-dir", "/proc/nope/logs", "train.py"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "cannot write logs to --log-dir /proc/nope/logs" in err
    assert not (here / "logs").exists()
    assert main(["launch", "--dry-run", "--log-dir", str(here / "new" / "logs"), "train.py"]) == 0
    assert not (here / "new").exists()  # a dry run makes nothing


def test_this_machine_named_in_h_is_told_to_leave_h_out(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`-H localhost:2` (torchrun's habit) with no sshd here: the fix is to leave -H out, not to
    start sshd or to edit a cluster file that was never used."""
    code = main(["launch", "-H", "localhost:2", "train.py"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "to run on this machine alone, leave -H out" in err, err
    assert "cluster file" not in err, err


HOSTS_NOT_SET_UP = "gpu1.invalid:2,gpu2.invalid"  # RFC 6761: a name that never resolves


def test_a_dry_run_works_offline_with_placeholders_a_note_and_the_restart_budget(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["launch", "-H", HOSTS_NOT_SET_UP, "--max-restarts", "2", "--dry-run", "train.py"]
    assert main([*argv, "--lr", "3"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "note: made offline, without the nodes" in out
    assert "a launch probes every node first" in out
    assert "note: 192.0.2.1 stands for gpu1.invalid's address" in out
    assert "--rdzv-endpoint=192.0.2.1:29500" in out and "train.py --lr 3" in out
    assert "herd restarts the whole job up to 2 time(s)" in out
    assert "world size 3" in out


def test_a_dry_run_gives_its_plan_as_json(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    argv = ["launch", "-H", HOSTS_NOT_SET_UP, "--max-restarts", "1", "--dry-run", "--json"]
    assert main([*argv, "train.py"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 3 and plan["restarts"]["max_restarts"] == 1
    assert [n["host"] for n in plan["nodes"]] == ["gpu1.invalid", "gpu2.invalid"]
    assert plan["nodes"][0]["rendezvous_host"] and plan["nodes"][0]["workers"] == 2
    assert plan["nodes"][1]["command"][-1] == "train.py"
    assert any("made offline" in note for note in plan["notes"])
    assert main(["launch", "--json", "train.py"]) == 2  # a plan only with --dry-run
    assert "--json goes with --dry-run" in capsys.readouterr().err


def test_launch_help_says_a_dry_run_probes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--help"]) == 0
    assert "probes every node" in " ".join(capsys.readouterr().out.split())


def test_a_herd_option_after_the_script_is_passed_on_with_a_warning(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", "--dry-run", "train.py", "--nproc", "2", "--lr", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.rstrip().endswith("train.py --nproc 2 --lr 3")  # the script's still
    assert "world size 1" in captured.out
    assert "warning: --nproc comes after train.py, so it goes to the script" in captured.err
    assert main(["launch", "--dry-run", "train.py", "--lr", "3"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_spares_are_the_last_hosts_and_take_no_rank(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--spares N`: the last N hosts of -H are hot spares, left out of the plan (a dry run
    made offline too), named in its notes; spares that leave no node to run are refused."""
    import json

    hosts = f"{HOSTS_NOT_SET_UP},gpu3.invalid:4"
    assert main(["launch", "-H", hosts, "--spares", "1", "--dry-run", "--json", "train.py"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [n["host"] for n in plan["nodes"]] == ["gpu1.invalid", "gpu2.invalid"]
    assert plan["world_size"] == 3
    spare = "gpu3.invalid is a hot spare: it takes no rank, and takes a lost node's place"
    assert spare in plan["notes"]
    assert main(["launch", "-H", hosts, "--spares", "3", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "--spares 3 leaves no node to run the job (3 node(s) in -H)" in err
    assert "give at most --spares 2" in err and "Traceback" not in err
