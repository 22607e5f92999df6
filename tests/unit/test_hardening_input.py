"""Bad input gets an error naming the file, the line and the fix (exit 2), never a traceback;
what reaches a node's shell is only what a host or a path can be."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from test_hardening_rendezvous import facts_for  # the recorded quick-probe facts

from torchherd.cli import main
from torchherd.errors import ConfigError
from torchherd.plan import JobSpec, make_plan
from torchherd.spec import (
    load_cluster_file,
    load_hostfile,
    parse_cluster_toml,
    parse_host_list,
    read_env_file,
)
from torchherd.transport.base import as_shell, remote_line

# ---- item 4: host names ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    ["a$(id)", "a`id`", "x\\u001b[31m", "a b", "-oProxyCommand=x", "a;b", "gpu1:2222", "a/b"],
)
def test_a_host_that_is_not_an_ssh_destination_is_refused_with_its_line(host: str) -> None:
    text = f'[cluster]\npython = "python3"\n\n[[node]]\nhost = "{host}"\n'
    with pytest.raises(ConfigError) as caught:
        parse_cluster_toml(text, "herd.toml")
    assert caught.value.message.startswith("herd.toml line 5: [[node]] #1 host = ")
    assert "ssh destination" in caught.value.message
    assert "user@HOST" in caught.value.remedy
    assert "\x1b" not in caught.value.message  # shown escaped, not sent to the terminal


@pytest.mark.parametrize(
    "host, kept",
    [
        ("gpu1", "gpu1"),
        ("alice@gpu-1.example.com", "alice@gpu-1.example.com"),
        ("10.0.0.7", "10.0.0.7"),
        ("[fe80::1]", "fe80::1"),
        ("root@[2001:db8::7]", "root@2001:db8::7"),
        ("node_01", "node_01"),
    ],
)
def test_real_destinations_are_accepted(host: str, kept: str) -> None:
    cluster = parse_cluster_toml(f'[[node]]\nhost = "{host}"\n', "herd.toml")
    assert cluster.nodes[0].host == kept


def test_a_port_gets_its_own_fix() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_cluster_toml('[[node]]\nhost = "gpu1:2222"\n', "herd.toml")
    assert "`Host gpu1` / `Port 2222`" in caught.value.message


def test_the_same_node_twice_is_refused_whatever_the_user_part() -> None:
    text = '[[node]]\nhost = "x"\n\n[[node]]\nhost = "gpu2"\n\n[[node]]\nhost = "me@X"\n'
    with pytest.raises(ConfigError) as caught:
        parse_cluster_toml(text, "herd.toml")
    assert caught.value.message.startswith("herd.toml line 8: [[node]] #3: duplicate host")
    assert "line 2" in caught.value.message
    with pytest.raises(ConfigError, match="same node"):
        parse_host_list("x:2,me@x:2")


def test_hostfile_duplicates_and_bad_hosts_name_their_line(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("gpu1 slots=2\nroot@gpu1 slots=2\n")
    with pytest.raises(ConfigError, match=r"line 2: host 'root@gpu1' is the same node as line 1"):
        load_hostfile(hostfile)
    hostfile.write_text("gpu1 slots=2\n$(reboot) slots=2\n")
    with pytest.raises(ConfigError, match=r"line 2: '\$\(reboot\)'"):
        load_hostfile(hostfile)


# ---- item 10: files that are not UTF-8 -----------------------------------------------------------


def test_non_utf8_files_are_config_errors_with_a_fix(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_bytes(b"gpu1 slots=2\ngp\xe9u2\n")
    for load in (load_hostfile, load_cluster_file, read_env_file):
        with pytest.raises(ConfigError) as caught:
            load(hostfile)
        assert "is not UTF-8 text" in caught.value.message and str(hostfile) in caught.value.message
        assert "iconv" in caught.value.remedy


def test_the_cli_says_error_and_fix_for_a_non_utf8_hostfile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_bytes(b"gp\xe9u2 slots=1\n")
    code = main(["launch", "-c", str(hostfile), "--dry-run", "train.py"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: cluster file") and "\n  fix: " in err and "Traceback" not in err


# ---- item 11: env_file --------------------------------------------------------------------------


def test_env_file_inline_comments_are_not_part_of_the_value(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    env.write_text(
        "HF_TOKEN=hf_abc123 # the read token\n"
        "export WANDB_API_KEY='k#ey with # inside'  # quoted: the # stays\n"
        'PLAIN="quoted"\n'
        "HASHED=abc#def\n"
        "# a comment line\n"
    )
    env.chmod(0o600)
    assert read_env_file(env) == {
        "HF_TOKEN": "hf_abc123",
        "WANDB_API_KEY": "k#ey with # inside",
        "PLAIN": "quoted",
        "HASHED": "abc#def",
    }


def test_env_file_unclosed_quote_names_the_line(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    env.write_text("A=1\nB='open\n")
    env.chmod(0o600)
    with pytest.raises(ConfigError, match=r"\.env line 2: expected KEY=VALUE"):
        read_env_file(env)


def test_env_file_readable_by_others_is_warned_with_the_chmod(tmp_path: Path) -> None:
    env = tmp_path / ".env"
    env.write_text("HF_TOKEN=hf_abc123\n")
    heard: list[tuple[str, str]] = []
    env.chmod(0o644)
    read_env_file(env, warn=lambda message, fix: heard.append((message, fix)))
    assert heard == [
        (
            f"env_file {env} is readable by its group and every user (it holds secrets; s3fs "
            "and other tools refuse such a file)",
            f"chmod 600 {env}",
        )
    ]
    heard.clear()
    env.chmod(0o600)
    read_env_file(env, warn=lambda message, fix: heard.append((message, fix)))
    assert heard == []


def test_env_file_warning_reaches_stderr_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = tmp_path / ".env"
    env.write_text("HF_TOKEN=hf_abc123\n")
    env.chmod(0o640)
    read_env_file(env)
    err = capsys.readouterr().err
    assert err == (
        f"warning: env_file {env} is readable by its group (it holds secrets; s3fs and other "
        f"tools refuse such a file)\n  fix: chmod 600 {env}\n"
    )


# ---- item 5: sync leaves the env_file out; dry-run masks the command line ----------------


def test_sync_always_excludes_the_env_file(tmp_path: Path) -> None:
    from torchherd.ops.sync import env_file_excludes

    (tmp_path / "conf").mkdir()
    secret = tmp_path / "conf" / "prod[1].env"
    secret.write_text("A=1\n")
    (tmp_path / "herd.toml").write_text(
        '[cluster]\nenv_file = "conf/prod[1].env"\n\n[[node]]\nhost = "gpu1"\n'
    )
    cluster = load_cluster_file(tmp_path / "herd.toml")
    assert env_file_excludes(cluster, tmp_path) == ["/conf/prod\\[1].env"]
    plain = cluster.model_copy(update={"env_file": str(tmp_path / ".env")})
    assert env_file_excludes(plain, tmp_path) == ["/.env"]
    assert env_file_excludes(plain, tmp_path / "conf") == []  # outside what is copied


def test_dry_run_masks_secrets_in_the_command_line() -> None:
    cluster = parse_host_list("node1,node2")
    facts = {"node1": facts_for("node1", 1), "node2": facts_for("node2", 2)}
    job = JobSpec(entry=("train.py", "--token", "hf_supersecret"))
    plan = make_plan(cluster, job, facts, {"HF_TOKEN": "hf_supersecret"})
    text = plan.render()
    assert "hf_supersecret" not in text
    assert "--token '********'" in text or "--token ********" in text


# ---- item 12: ~ in the node's python ------------------------------------------------------------


def test_a_home_relative_program_is_expanded_by_the_nodes_shell(tmp_path: Path) -> None:
    line = as_shell(["~/venv/bin/python", "-m", "torchherd.agent", "~/not-expanded"])
    assert line == "\"$HOME\"/venv/bin/python -m torchherd.agent '~/not-expanded'"
    home = tmp_path / "home"
    (home / "venv bin").mkdir(parents=True)
    program = home / "venv bin" / "py"
    program.write_text('#!/bin/sh\necho ran "$@"\n')
    program.chmod(0o755)
    remote = remote_line(["~/venv bin/py", "a b"], "~", {"X": "1"})
    done = subprocess.run(
        ["sh", "-c", remote],
        env={"HOME": str(home), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
    )
    assert done.stdout == "ran a b\n", done.stderr


# ---- item 15: open files -------------------------------------------------------------------------


def test_the_cli_raises_the_open_file_soft_limit_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"hard limit {hard}: nothing to raise")
    script = (
        "import resource, sys\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from torchherd.cli import main\n"
        "main(['--help'])\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    raised = int(done.stderr.strip().splitlines()[-1])
    expected = hard if hard != resource.RLIM_INFINITY else 1 << 20
    assert raised == expected > 256
