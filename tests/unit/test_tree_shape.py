"""The tree's shape (transport/tree.py) and the fan-out's ssh lines (agent/fanout.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from torchherd.agent.fanout import node_argv
from torchherd.transport.tree import inner_count, shape


def test_inner_nodes_of_at_most_32_others_each_and_at_least_two() -> None:
    assert [inner_count(n) for n in (3, 12, 32, 66, 67, 1000)] == [2, 2, 2, 2, 3, 31]
    parents = shape([f"n{k}" for k in range(1, 13)])
    inner = [h for h, p in parents.items() if h == p]
    assert inner == ["n1", "n2"]
    below = {i: [h for h, p in parents.items() if p == i and h != i] for i in inner}
    assert below == {
        "n1": ["n3", "n5", "n7", "n9", "n11"],
        "n2": ["n4", "n6", "n8", "n10", "n12"],
    }


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

    cluster = ClusterSpec(nodes=tuple(NodeSpec(host=f"n{k}") for k in range(1, 13)), tree_above=4)
    ssh = SshTransport(cluster, tree=True)
    try:
        assert ssh.tree is not None and ssh.tree.inner == ["n1", "n2"]
        ssh._masters |= {"n1", "n2"}  # both inner nodes connected at the launch
        leaf = cluster.node("n4")  # in n2's subtree
        assert ssh.tree.inner_for(leaf) == "n2"
        ssh.lost("n2")
        assert ssh.tree.inner_for(leaf) == "n1"
        assert not ssh.connected("n2")
        ssh.lost("n1")
        assert ssh.tree.inner_for(leaf) is None  # no inner node left: reached directly
    finally:
        asyncio.run(ssh.close())  # its private control directory
