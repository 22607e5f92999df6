"""Which nodes a sync chains together: those that lack the same files (they are passed on
from node to node); a node that lacks something else is sent its own."""

from __future__ import annotations

from pathlib import Path

from tests.wheels import make_wheel
from torchherd.envs.ship import EnvSync
from torchherd.envs.uvbin import uv_binary, uv_version
from torchherd.spec import ClusterSpec, NodeSpec
from torchherd.transport.local import LocalTransport


def test_nodes_that_lack_the_same_files_form_one_chain_in_cluster_order(tmp_path: Path) -> None:
    wheels = {
        "alpha": make_wheel(tmp_path, "alpha", "1.0"),
        "beta": make_wheel(tmp_path, "beta", "1.0"),
    }
    nodes = tuple(NodeSpec(host=f"n{i}") for i in range(1, 6))
    cluster = ClusterSpec(nodes=nodes, source="test")
    sync = EnvSync(cluster, transport=LocalTransport(cluster))  # nothing is run: no ssh needed
    has_uv = [uv_version()]
    alpha = {wheels["alpha"].name: wheels["alpha"].stat().st_size}
    facts = {
        "n1": {"cache": {}, "uv": []},
        "n2": {"cache": {}, "uv": []},  # fresh, as n1 and n4
        "n3": {"cache": alpha, "uv": has_uv},  # lacks beta only: alone
        "n4": {"cache": {}, "uv": []},
        "n5": {"cache": {}, "uv": has_uv},  # lacks both wheels, has uv: alone
    }
    work = {host: (facts[host], wheels) for host in facts}
    chains = sync._chains(list(nodes), work, Path(uv_binary()))
    assert [[n.host for n in chain] for chain, _ in chains] == [["n1", "n2", "n4"]]
    assert sorted(p.name for p in chains[0][1]) == sorted(
        [wheels["alpha"].name, wheels["beta"].name, Path(uv_binary()).name]
    )
