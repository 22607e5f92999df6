"""herd sync and ssh-setup pieces that need no node: rsync's command line and statistics,
key choice, and the authorized_keys script run against a temporary home."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from torchherd.errors import ConfigError
from torchherd.ops.sshsetup import INSTALL_SCRIPT, choose_key
from torchherd.ops.sync import Syncer, destination, parse_stats, rsync_argv, rsync_path
from torchherd.spec import local_cluster, parse_host_list

# The --stats block of rsync 3.2 (numbers with thousands separators).
STATS = """\
Number of files: 5 (reg: 3, dir: 2)
Number of created files: 0
Number of regular files transferred: 1
Total file size: 6,041 bytes
Total transferred file size: 17 bytes
Literal data: 17 bytes
Total bytes sent: 1,234
Total bytes received: 70
sent 1,234 bytes  received 70 bytes  2,608.00 bytes/sec
"""


def test_parse_stats() -> None:
    assert parse_stats(STATS) == {"bytes_sent": 1234, "files": 1}
    assert parse_stats("") == {"bytes_sent": 0, "files": 0}


def test_rsync_argv_uses_our_ssh_gitignore_and_excludes(tmp_path: Path) -> None:
    ssh = ["/usr/bin/ssh", "-F", "/my config", "-o", "BatchMode=yes"]
    argv = rsync_argv(tmp_path, "alice@gpu1", "~/proj", ssh, ["*.ckpt", "data/"])
    assert argv[argv.index("-e") + 1] == "/usr/bin/ssh -F '/my config' -o BatchMode=yes"
    assert "--filter=:- .gitignore" in argv
    assert {"--exclude=/.git/", "--exclude=*.ckpt", "--exclude=data/"} <= set(argv)
    assert "--delete" not in argv and "--stats" in argv
    assert argv[-2:] == [f"{tmp_path}/", "alice@gpu1:proj/"]
    assert rsync_argv(tmp_path, "fe80::1", "/srv/p", ssh, delete=True)[-1] == "[fe80::1]:/srv/p/"
    assert [rsync_path(p) for p in ("~", "~/a/b", "/abs", "rel")] == [".", "a/b", "/abs", "rel"]


def test_destination_defaults_to_the_same_absolute_path(tmp_path: Path) -> None:
    cluster = parse_host_list("gpu1")
    assert destination(cluster, tmp_path) == str(tmp_path.resolve())
    assert destination(cluster.model_copy(update={"workdir": "~/p"}), tmp_path) == "~/p"


def test_sync_needs_a_cluster_and_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="there is none"):
        Syncer(local_cluster(), tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        Syncer(parse_host_list("gpu1"), tmp_path / "missing")


def test_choose_key_prefers_an_existing_identity(tmp_path: Path) -> None:
    rsa, ed = tmp_path / "id_rsa", tmp_path / "id_ed25519"
    config = {"identityfile": [str(rsa), str(ed), str(tmp_path / "id_ed25519_sk")]}
    assert choose_key(config) == (ed, False)  # none exists: make the ed25519 one
    rsa.write_text("key")
    assert choose_key(config) == (rsa, True)
    assert choose_key(config, str(tmp_path / "mine")) == (tmp_path / "mine", False)


def run_install(home: Path, key: str) -> None:
    subprocess.run(
        ["sh", "-c", INSTALL_SCRIPT],
        input=key + "\n",
        text=True,
        check=True,
        env=dict(os.environ, HOME=str(home)),
        timeout=60,
    )


def test_install_script_appends_once_with_strict_modes(tmp_path: Path) -> None:
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB herd@laptop"
    run_install(tmp_path, key)
    run_install(tmp_path, key)  # a second ssh-setup adds nothing
    authorized = tmp_path / ".ssh" / "authorized_keys"
    assert authorized.read_text() == key + "\n"
    assert authorized.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / ".ssh").stat().st_mode & 0o777 == 0o700
    authorized.write_text("ssh-rsa OLD admin")  # no newline at the end
    run_install(tmp_path, key)
    assert authorized.read_text() == f"ssh-rsa OLD admin\n{key}\n"
