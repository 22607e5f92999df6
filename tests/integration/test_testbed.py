"""The testbed itself: real namespaces, real sshd, real faults. If these fail, every other
integration test's result is meaningless, so each property the others rely on is checked here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

from tests.integration.conftest import require_testbed
from tests.testbed import Testbed, TestNode

# Exit 0 if a TCP connection to argv[1]:argv[2] opens within argv[3] seconds, else 1.
_CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), float(sys.argv[3])).close()\n"
    "except OSError as exc:\n"
    "    sys.exit(f'{type(exc).__name__}: {exc}')\n"
)


def _connects(bed: Testbed, src: str, dst: TestNode, port: int, timeout: float = 1.0) -> bool:
    argv = [sys.executable, "-c", _CONNECT, dst.addr, str(port), str(timeout)]
    return bed.ns_run(src, argv, check=False, timeout=timeout + 10).returncode == 0


def test_each_node_has_its_own_name_and_hosts_file(testbed: Testbed) -> None:
    names = [n.name for n in testbed.nodes]
    for node in testbed.nodes:
        out = testbed.ssh(node, f"hostname; getent hosts {' '.join(names)}")
        assert out.returncode == 0, out.stderr
        hostname, *lines = out.stdout.splitlines()
        assert hostname == node.name
        resolved = {line.split()[1]: line.split()[0] for line in lines}
        # The stock-Debian trap: a node's own name is loopback, the others are reachable.
        assert resolved == {n.name: "127.0.1.1" if n is node else n.addr for n in testbed.nodes}


def test_ns_run_enters_the_node(testbed: Testbed, tmp_path: Path) -> None:
    node = testbed.node("node3")
    out = testbed.ns_run(node, ["sh", "-c", "hostname; pwd; ls /sys/class/net"], cwd=tmp_path)
    hostname, cwd, *nics = out.stdout.split()
    assert (hostname, cwd) == ("node3", str(tmp_path))
    assert sorted(nics) == ["eth0", "lo"]
    assert testbed.node(2) is node and testbed.node(node.addr) is node


def test_node_reaches_peer_sshd_over_the_bridge(testbed: Testbed) -> None:
    peer = testbed.node("node2")
    out = testbed.ssh("node1", f'{sys.executable} -c "{_CONNECT}" {peer.addr} 22 3')
    assert out.returncode == 0, out.stderr


def test_partition_cuts_the_node_off_and_heal_restores_it(clean_faults: Testbed) -> None:
    bed = clean_faults
    node2 = bed.node("node2")
    bed.partition(node2)
    started = time.monotonic()
    out = bed.ssh(node2, "true", timeout=20, connect_timeout=2)
    assert out.returncode == 255  # ssh's own failure, not the command's
    assert time.monotonic() - started < 2 + 2  # within ConnectTimeout plus slack
    assert not _connects(bed, "node1", node2, 22)
    bed.heal(node2)
    assert bed.ssh(node2, "true").returncode == 0
    assert _connects(bed, "node1", node2, 22)


def test_block_port_drops_incoming_tcp(clean_faults: Testbed) -> None:
    bed = clean_faults
    node1 = bed.node("node1")
    server = bed.ns_popen(
        node1,
        [sys.executable, "-m", "http.server", "29555", "--bind", node1.addr],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not _connects(bed, "node2", node1, 29555) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _connects(bed, "node2", node1, 29555)
        bed.block_port(node1, 29555)
        assert not _connects(bed, "node2", node1, 29555)
        assert _connects(bed, "node2", node1, 22)  # only that port
        bed.unblock_port(node1, 29555)
        assert _connects(bed, "node2", node1, 29555)
    finally:
        server.kill()
        server.wait(timeout=10)


def test_delay_slows_the_link_and_undelay_restores_it(clean_faults: Testbed) -> None:
    bed = clean_faults
    # The fastest of five connects: a delay holds back every one of them, a loaded machine
    # (a test beside this one) only some (one connect after undelay was seen to take 0.29 s).
    probe = (
        "import socket, sys, time\n"
        "def once():\n"
        "    t = time.monotonic()\n"
        "    socket.create_connection((sys.argv[1], 22), 5).close()\n"
        "    return time.monotonic() - t\n"
        "print(min(once() for _ in range(5)))\n"
    )

    def fastest_connect() -> float:
        out = bed.ns_run("node1", [sys.executable, "-c", probe, bed.node("node4").addr])
        return float(out.stdout)

    bed.delay("node4", 150)
    assert fastest_connect() >= 0.14  # the SYN-ACK waits 150 ms on node4
    bed.undelay("node4")
    assert fastest_connect() < 0.1


def test_add_nic_gives_the_node_a_second_interface(clean_faults: Testbed) -> None:
    bed = clean_faults
    bed.add_nic("node2")
    out = bed.ns_run("node2", ["ip", "-o", "-4", "addr", "show", "dev", "docker0", "up"])
    assert "172.31.0.1/16" in out.stdout
    bed.reset_faults()
    out = bed.ns_run("node2", ["ls", "/sys/class/net"])
    assert sorted(out.stdout.split()) == ["eth0", "lo"]


def test_processes_with_env_finds_exactly_the_tagged_processes(testbed: Testbed) -> None:
    job = uuid.uuid4().hex
    out = testbed.ssh("node1", f"env HERD_JOB_ID={job} sleep 30 >/dev/null 2>&1 </dev/null &")
    assert out.returncode == 0, out.stderr
    # ssh returns once the shell exits; its background child may not have exec'd `env` yet.
    deadline = time.monotonic() + 5
    while not (pids := testbed.processes_with_env("HERD_JOB_ID", job)):
        assert time.monotonic() < deadline, "the tagged sleep never appeared"
        time.sleep(0.05)
    assert len(pids) == 1
    while Path(f"/proc/{pids[0]}/comm").read_text().strip() != "sleep":  # env execs sleep
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert testbed.processes_with_env("HERD_JOB_ID", job[:-1]) == []  # exact match only
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while testbed.processes_with_env("HERD_JOB_ID", job) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert testbed.processes_with_env("HERD_JOB_ID", job) == []


def test_write_cluster_file(testbed: Testbed, tmp_path: Path) -> None:
    path = testbed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=["node1", {"host": "node2", "nproc": 1}],
        env={"X": "1", "A.B": 'q"uote'},
        workdir=str(tmp_path),
    )
    doc = tomllib.loads(path.read_text())
    assert doc["cluster"] == {
        "python": sys.executable,
        "ssh_config": str(testbed.ssh_config),
        "connect_timeout": 5,
        "env": {"X": "1", "A.B": 'q"uote'},
        "workdir": str(tmp_path),
    }
    assert doc["node"] == [{"host": "node1"}, {"host": "node2", "nproc": 1}]
    default = tomllib.loads(testbed.write_cluster_file().read_text())
    assert [n["host"] for n in default["node"]] == [n.name for n in testbed.nodes]


def test_close_removes_everything_even_with_faults_active() -> None:
    require_testbed()
    bed = Testbed(2, hosts_loopback=False)
    with bed:
        assert bed.ssh("node1", "getent hosts node1").stdout.split()[0] == bed.node(0).addr
        bed.partition("node2")
        bed.block_port("node1", 29555)
        bed.delay("node1", 20)
        bed.add_nic("node1")
        sshd_pids = [p.pid for p in bed._sshd.values()]
        names = [n.ns for n in bed.nodes]
    bed.close()  # idempotent
    netns = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=60
    ).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=60).stdout
    assert bed.tag not in netns and bed.tag not in links
    assert not any(Path("/etc/netns", ns).exists() for ns in names)
    assert not bed.tmp.exists()
    assert not any(Path(f"/proc/{pid}").exists() for pid in sshd_pids)
