"""The tree's shape (transport/tree.py) and the fan-out's ssh lines (agent/fanout.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from torchherd.agent.fanout import node_argv
from torchherd.transport.tree import inner_count, shape


def test_inner_nodes_are_the_last_and_start_at_most_32_others_each() -> None:
    assert [inner_count(n) for n in (3, 12, 33, 34, 66, 67, 1000)] == [1, 1, 1, 2, 2, 3, 31]
    parents = shape([f"n{k}" for k in range(1, 13)])
    # One inner node, the last: the first (node rank 0) hosts the rendezvous.
    assert [h for h, p in parents.items() if h == p] == ["n12"]
    assert sorted(h for h, p in parents.items() if p == "n12" and h != "n12") == sorted(
        f"n{k}" for k in range(1, 12)
    )
    parents = shape([f"n{k}" for k in range(1, 71)])
    inner = [h for h, p in parents.items() if h == p]
    assert inner == ["n68", "n69", "n70"]
    below = {i: [h for h, p in parents.items() if p == i and h != i] for i in inner}
    assert below["n68"][:3] == ["n1", "n4", "n7"] and below["n70"][:2] == ["n3", "n6"]
    assert sorted(len(hosts) for hosts in below.values()) == [22, 22, 23]
    assert all(len(hosts) <= 32 for hosts in below.values())


def test_the_fanout_names_the_launcher_and_keeps_only_a_config_file_it_has(
    tmp_path: Path,
) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("")
    line = "cd /w && env HERD_RELAY_HOST=@ssh-client python3 -m torchherd.agent.relay"
    argv = ["ssh", "-F", str(config), "-o", "BatchMode=yes", "-T", "n5", "--", line]
    assert node_argv(argv, "10.0.0.1") == [
        "ssh",
        "-F",
        str(config),
        "-o",
        "BatchMode=yes",
        "-T",
        "n5",
        "--",
        "cd /w && env HERD_RELAY_HOST=10.0.0.1 python3 -m torchherd.agent.relay",
    ]
    missing = ["ssh", "-F", str(tmp_path / "not-here"), "-T", "n5", "--", line]
    assert node_argv(missing, "10.0.0.1")[:3] == ["ssh", "-T", "n5"]


def test_a_relay_that_cannot_dial_back_or_whose_link_dropped_is_an_unreachable_node() -> None:
    from torchherd.agent.relay import CANNOT_CONNECT
    from torchherd.transport.relay import LINK_LOST, LINK_LOST_MARK
    from torchherd.transport.tree import classify_relay_failure

    found = classify_relay_failure("n5", 1, f"{CANNOT_CONNECT}: 10.0.0.1:4000 refused\n")
    assert found is not None and found.reason == "relay" and "tree_above" in found.remedy
    lost = classify_relay_failure("n5", LINK_LOST, f"{LINK_LOST_MARK} n5\n")
    assert lost is not None and lost.reason == "link-lost"
    assert classify_relay_failure("n5", 3, "Traceback ...\n") is None


def test_a_lost_inner_node_carries_no_subtree_until_it_is_connected_again() -> None:
    """A cut link closes nothing: the launcher's master to a lost inner node looks open for
    a while. Once herd has judged it lost (a sweep found no answer), its subtree's commands
    go through the other inner node at once, and its master is opened again on next use."""
    from torchherd.spec import ClusterSpec, NodeSpec
    from torchherd.transport.ssh import SshTransport

    cluster = ClusterSpec(nodes=tuple(NodeSpec(host=f"n{k}") for k in range(1, 41)), tree_above=4)
    ssh = SshTransport(cluster, tree=True)
    try:
        assert ssh.tree is not None and ssh.tree.inner == ["n39", "n40"]
        ssh._masters |= {"n39", "n40"}  # both inner nodes connected at the launch
        leaf = cluster.node("n2")  # in n40's subtree
        assert ssh.tree.inner_for(leaf) == "n40"
        ssh.lost("n40")
        assert ssh.tree.inner_for(leaf) == "n39"
        assert not ssh.connected("n40")
        ssh.lost("n39")
        assert ssh.tree.inner_for(leaf) is None  # no inner node left: reached directly
    finally:
        asyncio.run(ssh.close())  # its private control directory
