"""Every way ssh fails to reach a node is named, with its reason and a fix, and exits 3.

Each broken node is a real ssh destination on the testbed, broken the way it breaks in the field:
nothing listening, a key the node does not accept, a host key that changed, a name that does not
resolve. The launcher runs inside node1 (its namespace has no DNS server, so an unknown name
fails at once without a query leaving the machine).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.testbed import Testbed


def test_each_ssh_failure_is_classified(testbed: Testbed, tmp_path: Path) -> None:
    target = testbed.node("node2")
    wrong_key = tmp_path / "wrong_key"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong_key)],
        check=True,
        timeout=60,
    )
    # A known_hosts that remembers another key for node2: what a reinstalled node looks like.
    changed_hosts = tmp_path / "changed_known_hosts"
    changed_hosts.write_text(f"{target.addr} {(wrong_key.with_suffix('.pub')).read_text()}")
    good = testbed.ssh_config.read_text()
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(
        f"""{good}
Host refused-node
    HostName {target.addr}
    Port 2
    User root
Host auth-node
    HostName {target.addr}
    User root
    IdentityFile {wrong_key}
    IdentitiesOnly yes
    UserKnownHostsFile {tmp_path / "kh"}
Host hostkey-node
    HostName {target.addr}
    User root
    IdentityFile {testbed.tmp / "id_ed25519"}
    UserKnownHostsFile {changed_hosts}
Host unknown-node
    HostName no-such-host.invalid
"""
    )
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=["node3", "refused-node", "auth-node", "hostkey-node", "unknown-node"],
        ssh_config=str(ssh_config),
        connect_timeout=3,
    )
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    run = testbed.ns_run(
        "node1",
        [sys.executable, "-m", "torchherd", "launch", "-c", str(path), str(script)],
        check=False,
        timeout=60,
        env={"HOME": str(tmp_path), "HERD_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 3, run.stdout + run.stderr
    errors = run.stderr
    assert "4 of 5 node(s) unreachable" in errors, errors
    assert "refused-node: connection refused" in errors
    assert "auth-node: authentication failed" in errors and "herd ssh-setup" in errors
    assert "hostkey-node: host key changed" in errors and "ssh-keygen -R hostkey-node" in errors
    assert "unknown-node: unknown host name" in errors
    assert "node3:" not in errors
    assert "Traceback" not in errors
