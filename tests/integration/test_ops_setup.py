"""`herd init --probe` and `herd ssh-setup` against the testbed's real sshd.

The testbed's sshd has password login off, so the password prompt itself cannot run here;
what can is tested for real: key creation in a fresh home, host keys recorded with
accept-new, a changed host key refused, and the per-node verification report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.testbed import Testbed
from torchherd.spec import load_cluster_file


def herd(args: list[str], tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchherd", *args],
        cwd=tmp,
        env=dict(os.environ, HERD_HOME=str(tmp / "herd-home"), **env),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # no controlling terminal: ssh could not ask for a password
    )


def test_init_probe_writes_a_valid_file_and_never_overwrites(
    testbed: Testbed, tmp_path: Path
) -> None:
    target = tmp_path / "herd.toml"
    args = [
        "init",
        "node1",
        "node2:3",
        "--probe",
        "--ssh-config",
        str(testbed.ssh_config),
        "--workdir",
        "~/project",
    ]
    out = herd(args, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "wrote herd.toml: 2 node(s) [node1×1, node2×3]" in out.stdout
    cluster = load_cluster_file(target)
    assert [(n.host, n.nproc) for n in cluster.nodes] == [("node1", 1), ("node2", 3)]
    assert cluster.workdir == "~/project" and cluster.ssh_config == str(testbed.ssh_config)
    assert 'host = "node1"  # no GPU found' in target.read_text()

    again = herd(["init", "node3"], tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr
    assert "--force" in again.stderr and "Traceback" not in again.stderr
    assert load_cluster_file(target).nodes[0].host == "node1"  # untouched
    forced = herd(["init", "node3", "--force"], tmp_path)
    assert forced.returncode == 0
    assert [n.host for n in load_cluster_file(target).nodes] == ["node3"]


def ssh_config(testbed: Testbed, tmp: Path, identity: Path, known_hosts: Path) -> Path:
    blocks = [
        f"Host {n.name}\n  HostName {n.addr}\n  User root\n  IdentityFile {identity}\n"
        f"  IdentitiesOnly yes\n  UserKnownHostsFile {known_hosts}\n  LogLevel ERROR\n"
        for n in testbed.nodes
    ]
    path = tmp / f"ssh_config_{identity.name}"
    path.write_text("\n".join(blocks))
    return path


def table(stdout: str) -> dict[str, list[str]]:
    return {
        line.split()[0]: line.split()[1:] for line in stdout.splitlines() if line.startswith("node")
    }


def test_ssh_setup_creates_a_key_records_host_keys_and_reports_each_node(
    testbed: Testbed, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    known_hosts = tmp_path / "known_hosts"
    new_key = home / ".ssh" / "id_ed25519"
    config = testbed.write_cluster_file(
        tmp_path / "fresh.toml",
        nodes=["node1", "node2"],
        ssh_config=str(ssh_config(testbed, tmp_path, new_key, known_hosts)),
    )
    out = herd(["ssh-setup", "-c", str(config)], tmp_path, HOME=str(home))
    assert out.returncode == 3, out.stdout + out.stderr
    assert new_key.exists() and Path(f"{new_key}.pub").read_text().startswith("ssh-ed25519 ")
    assert f"creating an ed25519 key at {new_key}" in out.stdout
    assert "no terminal to ask for a password" in out.stdout
    rows = table(out.stdout)
    for name in ("node1", "node2"):
        # The new key is not authorized there and no password can be asked: reported, per node.
        assert rows[name][:2] == ["skipped", "recorded"]
        assert "authentication failed" in " ".join(rows[name][2:])
        addr = testbed.node(name).addr
        found = subprocess.run(
            ["ssh-keygen", "-F", addr, "-f", str(known_hosts)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert found.returncode == 0  # host key recorded (accept-new)

    # The testbed's key is authorized everywhere: nothing to install, every login verified.
    testbed_key = testbed.ssh_config.parent / "id_ed25519"
    good = testbed.write_cluster_file(
        tmp_path / "good.toml",
        nodes=["node1", "node2"],
        ssh_config=str(ssh_config(testbed, tmp_path, testbed_key, known_hosts)),
    )
    out = herd(["ssh-setup", "-c", str(good)], tmp_path, HOME=str(home))
    assert out.returncode == 0, out.stdout + out.stderr
    assert table(out.stdout) == {
        "node1": ["already", "known", "ok"],
        "node2": ["already", "known", "ok"],
    }
    assert "key login works on all 2 node(s)" in out.stdout

    # A node whose host key changed is refused, never trusted blindly.
    other = tmp_path / "other_host_key"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=60
    )
    node2 = testbed.node("node2").addr
    subprocess.run(
        ["ssh-keygen", "-R", node2, "-f", str(known_hosts)],
        capture_output=True,
        check=True,
        timeout=60,
    )
    with known_hosts.open("a") as handle:
        handle.write(
            f"{node2} {Path(f'{other}.pub').read_text().split(' ', 2)[0]} "
            f"{Path(f'{other}.pub').read_text().split()[1]}\n"
        )
    out = herd(["ssh-setup", "-c", str(good)], tmp_path, HOME=str(home))
    assert out.returncode == 3
    rows = table(out.stdout)
    assert rows["node1"] == ["already", "known", "ok"]
    assert rows["node2"][:2] == ["failed", "known"]
    assert "host key changed" in " ".join(rows["node2"]) and "ssh-keygen -R" in out.stdout
