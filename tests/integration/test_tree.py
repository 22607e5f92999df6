"""A launch through a tree of nodes (transport/tree.py) on 12 real-ssh testbed nodes.

With ``--tree-above 4`` the launcher opens an ssh connection to 1 inner node (node12, the
last) only; it starts the relays of the other 11 over its own ssh, and every relay dials back to
the launcher. What is checked, from what herd says and what runs: every rank of every node
steps, herd -v names the inner node each other node was reached through, the launcher holds
fewer ssh processes than there are nodes, and cutting an inner node off mid-run loses that
node alone: its subtree's ranks go on in the next attempt (--min-nodes 11).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import require_testbed
from tests.integration.herd_cli import SCRIPTS
from tests.integration.live import LiveHerd
from tests.testbed import Testbed

NODES = 12
INNER = ["node12"]


@pytest.fixture(scope="module")
def bed() -> Iterator[Testbed]:
    require_testbed()
    with Testbed(NODES) as testbed:
        yield testbed


def ssh_processes(launcher: int) -> list[int]:
    """The ssh clients the launcher started (its children) and its control masters (they
    detach from it; found by its private control directory, named in its clients' argv)."""
    children, control = [], None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher and stat.split()[1] == "(ssh)":
            children.append(int(entry))
            for word in argv:
                found = re.match(rb"ControlPath=(.+)/%C$", word)
                control = found.group(1) if found else control
    masters = []
    if control is not None:
        for entry in os.listdir("/proc"):
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except (OSError, NotADirectoryError):
                continue
            if b"ControlMaster=yes" in argv and b"ControlPath=" + control + b"/%C" in argv:
                masters.append(int(entry))
    return sorted(set(children) | set(masters))


def test_a_tree_launch_reaches_every_node_and_loses_only_a_cut_inner_node(
    bed: Testbed, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    path = bed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[{"host": node.name, "nproc": 1} for node in bed.nodes],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
        launcher_silence=10,
        connect_timeout=30,
    )
    args = ["-c", str(path), "--grace", "3", "-v", "--tree-above", "4", "--ranks", "all"]
    args += ["--max-restarts", "1", "--min-nodes", str(NODES - 1)]
    # 250 steps: the first attempt still runs when node12 is judged lost (10 s), and the
    # second (from step 0: steps.py keeps nothing) ends soon after.
    herd = LiveHerd([*args, "steps.py", "--steps", "250", "--quiet"], home, bed)
    herd.wait_for(r"STEPPING rank=", 300, count=NODES)
    held = ssh_processes(herd.process.pid)

    through: dict[str, list[str]] = {}
    for inner, hosts in re.findall(r"herd: reached through (\S+): (.+)", herd.output):
        through[inner] = hosts.split(", ")
    assert sorted(through) == INNER, herd.output
    leaves = sorted(host for hosts in through.values() for host in hosts)
    assert leaves == sorted(node.name for node in bed.nodes[: -len(INNER)]), herd.output
    assert "reached directly" not in herd.output, herd.output
    # 1 master and 1 agent session (the fan-out session ends once its subtree has
    # connected): fewer ssh processes than nodes.
    assert 0 < len(held) < NODES, held

    bed.partition("node12")
    try:
        herd.wait_for(r"going on without node12\b", 180)
        code = herd.finish(timeout=400)
    finally:
        bed.heal("node12")
    out = herd.output
    assert code == 0, out
    assert re.search(r"node12 stopped answering", out), out
    for leaf in through["node12"]:
        assert not re.search(rf"{leaf}\b[^\n]*stopped answering", out), out
        assert not re.search(rf"going on without [^:\n]*\b{leaf}\b", out), out
    hosts = [node["host"] for node in herd.record()["nodes"]]
    assert hosts == [node.name for node in bed.nodes if node.name != "node12"], hosts
    herd.assert_clean([node.name for node in bed.nodes], settle=90)


def test_a_node_its_inner_node_cannot_reach_is_reached_directly(
    bed: Testbed, tmp_path: Path
) -> None:
    """node3 refuses ssh from node5 (its inner node) but not from the launcher: herd reaches
    it directly, says so with ssh's reason, and the job runs on all five nodes."""
    home = tmp_path / "home"
    path = bed.write_cluster_file(
        tmp_path / "herd.toml",
        nodes=[{"host": node.name, "nproc": 1} for node in bed.nodes[:5]],
        workdir=str(SCRIPTS),
        env={"HERD_HOME": str(home)},
        connect_timeout=30,
    )
    iptables = bed._iptables_bin()
    rule = ["INPUT", "-s", bed.node("node5").addr, "-p", "tcp", "--dport", "22", "-j", "REJECT"]
    bed.ns_run("node3", [iptables, "-w", "5", "-A", *rule])
    try:
        args = ["-c", str(path), "--grace", "3", "-v", "--tree-above", "1", "--ranks", "all"]
        herd = LiveHerd([*args, "steps.py", "--steps", "20", "--quiet"], home, bed)
        code = herd.finish(timeout=300)
    finally:
        bed.ns_run("node3", [iptables, "-w", "5", "-D", *rule])
    out = herd.output
    assert code == 0, out
    assert len(re.findall(r"STEPPING rank=", out)) == 5, out
    assert re.search(r"herd: reached directly: node3 \(node5 could not reach it: .*refused", out)
    assert "herd: reached through node5: node1, node2, node4\n" in out + "\n", out
    herd.assert_clean([node.name for node in bed.nodes[:5]])
