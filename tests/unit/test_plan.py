"""The launch plan over recorded facts: explicit addresses, per-node NICs, is_host, secrets."""

from __future__ import annotations

from dataclasses import replace

import pytest

from torchherd.errors import ConfigError, NodeNotReady
from torchherd.facts import Interface, NodeFacts, Route
from torchherd.plan import JobSpec, crowded_nodes, make_plan
from torchherd.spec import ClusterSpec, NodeSpec, local_cluster


def facts(
    host: str,
    nics: list[tuple[str, str, int]],
    *,
    ssh_addr: str | None = None,
    gpus: int = 0,
    port: int | None = None,
    env: dict[str, str] | None = None,
    default_via: str | None = None,
) -> NodeFacts:
    """Facts as the probe reports them: lo, the NICs, and their connected routes."""
    routes = [
        {
            "iface": name,
            "dest": f"{addr.rsplit('.', 1)[0]}.0/{prefix}",
            "gateway": "0.0.0.0",
            "metric": 0,
        }
        for name, addr, prefix in nics
    ]
    if default_via:
        routes.append(
            {"iface": default_via, "dest": "0.0.0.0/0", "gateway": "1.1.1.1", "metric": 0}
        )
    return NodeFacts.from_probe(
        host,
        {
            "hostname": host,
            "hostname_addresses": ["127.0.1.1"],
            "ssh_server_addr": ssh_addr,
            "interfaces": [
                {"name": "lo", "addr": "127.0.0.1", "prefixlen": 8, "up": True, "loopback": True}
            ]
            + [
                {"name": n, "addr": a, "prefixlen": p, "up": True, "loopback": False}
                for n, a, p in nics
            ],
            "routes": routes,
            "python_version": "3.11.7",
            "torch_version": "2.13.0",
            "gpu_count": gpus,
            "env": env or {},
            "port": {"port": port, "free": True} if port else None,
        },
    )


def two_nodes(**cluster: object) -> ClusterSpec:
    return ClusterSpec(
        nodes=(NodeSpec(host="gpu1", nproc=2), NodeSpec(host="gpu2", nproc=1)), **cluster
    )


def recorded() -> dict[str, NodeFacts]:
    # gpu1 has docker0 first and the LAN on eth1: a hostname guess would pick the wrong NIC.
    return {
        "gpu1": facts(
            "gpu1",
            [("docker0", "172.17.0.1", 16), ("eth1", "10.0.0.1", 24)],
            ssh_addr="10.0.0.1",
            port=29517,
        ),
        "gpu2": facts(
            "gpu2",
            [("docker0", "172.17.0.1", 16), ("ens5", "10.0.0.2", 24)],
            ssh_addr="10.0.0.2",
            default_via="ens5",
        ),
    }


def test_multi_node_plan_uses_explicit_addresses_and_nics() -> None:
    plan = make_plan(
        two_nodes(), JobSpec(entry=("train.py", "--epochs", "3"), job_id="j1"), recorded()
    )
    first, second = plan.nodes
    assert plan.rdzv_endpoint == "10.0.0.1:29517"
    assert plan.world_size == 3
    assert (first.local_addr, first.iface, first.is_host) == ("10.0.0.1", "eth1", True)
    assert (second.local_addr, second.iface, second.is_host) == ("10.0.0.2", "ens5", False)
    # A static rendezvous: node ranks in the plan's order, the first node (the store's host)
    # rank 0, so no node guesses whether it hosts the store.
    assert "--node-rank=0" in first.argv and "--node-rank=1" in second.argv
    assert "--rdzv-endpoint=10.0.0.1:29517" in second.argv
    assert "--local-addr=10.0.0.2" in second.argv
    assert "--nnodes=2" in second.argv and "--nproc-per-node=1" in second.argv
    assert "--rdzv-id=j1" in first.argv and "--rdzv-backend=static" in first.argv
    assert first.argv[-3:] == ("train.py", "--epochs", "3")
    assert first.env["NCCL_SOCKET_IFNAME"] == "eth1" and second.env["GLOO_SOCKET_IFNAME"] == "ens5"


def test_user_set_ifname_is_kept() -> None:
    plan = make_plan(
        two_nodes(env={"NCCL_SOCKET_IFNAME": "ib0"}), JobSpec(entry=("t.py",)), recorded()
    )
    assert all(node.env["NCCL_SOCKET_IFNAME"] == "ib0" for node in plan.nodes)
    assert plan.nodes[1].env["GLOO_SOCKET_IFNAME"] == "ens5"
    on_node = recorded()
    on_node["gpu2"] = facts("gpu2", [("ens5", "10.0.0.2", 24)], env={"GLOO_SOCKET_IFNAME": "ens5"})
    plan = make_plan(two_nodes(), JobSpec(entry=("t.py",)), on_node)
    assert "GLOO_SOCKET_IFNAME" not in plan.nodes[1].env


def test_routed_network_uses_the_default_route() -> None:
    data = recorded()
    data["gpu2"] = facts("gpu2", [("ens5", "10.9.0.2", 24)], default_via="ens5")
    plan = make_plan(two_nodes(), JobSpec(entry=("t.py",)), data)
    assert (plan.nodes[1].local_addr, plan.nodes[1].iface) == ("10.9.0.2", "ens5")


def test_no_route_to_rendezvous_is_named() -> None:
    data = recorded()
    data["gpu2"] = facts("gpu2", [("ens5", "10.9.0.2", 24)])
    with pytest.raises(NodeNotReady, match="gpu2 has no route to the rendezvous address 10.0.0.1"):
        make_plan(two_nodes(), JobSpec(entry=("t.py",)), data)


def test_node_addr_and_iface_override_discovery() -> None:
    cluster = ClusterSpec(
        nodes=(
            NodeSpec(host="gpu1", addr="10.0.0.1"),
            NodeSpec(host="gpu2", addr="10.0.0.2", iface="eth9"),
        )
    )
    data = recorded()
    data["gpu1"] = facts("gpu1", [("eth1", "10.0.0.1", 24)], ssh_addr="192.168.5.5", port=29500)
    plan = make_plan(cluster, JobSpec(entry=("t.py",)), data)
    assert plan.rdzv_endpoint == "10.0.0.1:29500"
    assert (plan.nodes[1].local_addr, plan.nodes[1].iface) == ("10.0.0.2", "eth9")


def test_loopback_rendezvous_is_refused_for_multi_node() -> None:
    data = recorded()
    data["gpu1"] = facts("gpu1", [("eth1", "10.0.0.1", 24)], ssh_addr="127.0.0.1", port=29500)
    with pytest.raises(ConfigError, match="loopback"):
        make_plan(two_nodes(), JobSpec(entry=("t.py",)), data)


def test_nproc_defaults_to_gpus_then_one_and_cli_overrides() -> None:
    cluster = ClusterSpec(nodes=(NodeSpec(host="gpu1"), NodeSpec(host="gpu2")))
    data = recorded()
    data["gpu1"] = facts(
        "gpu1", [("eth1", "10.0.0.1", 24)], ssh_addr="10.0.0.1", gpus=8, port=29500
    )
    plan = make_plan(cluster, JobSpec(entry=("t.py",)), data)
    assert [n.nproc for n in plan.nodes] == [8, 1]
    plan = make_plan(cluster, JobSpec(entry=("t.py",), nproc=3), data)
    assert [n.nproc for n in plan.nodes] == [3, 3] and plan.world_size == 6


def test_accelerate_runs_distributed_on_nodes_without_a_gpu() -> None:
    data = recorded()
    data["gpu1"] = facts(
        "gpu1", [("eth1", "10.0.0.1", 24)], ssh_addr="10.0.0.1", gpus=2, port=29500
    )
    plan = make_plan(two_nodes(), JobSpec(entry=("t.py",)), data)
    gpu_node, cpu_node = plan.nodes
    assert "ACCELERATE_USE_CPU" not in gpu_node.env  # GPUs: Accelerate's default is right
    assert cpu_node.env["ACCELERATE_USE_CPU"] == "1"
    # What the user set is kept: in the cluster file, or in the node's own environment.
    plan = make_plan(two_nodes(env={"ACCELERATE_USE_CPU": "0"}), JobSpec(entry=("t.py",)), data)
    assert plan.nodes[1].env["ACCELERATE_USE_CPU"] == "0"
    data["gpu2"] = facts(
        "gpu2", [("ens5", "10.0.0.2", 24)], ssh_addr="10.0.0.2", env={"ACCELERATE_USE_CPU": "no"}
    )
    plan = make_plan(two_nodes(), JobSpec(entry=("t.py",)), data)
    assert "ACCELERATE_USE_CPU" not in plan.nodes[1].env


def test_module_entry_and_restarts() -> None:
    job = JobSpec(entry=("pkg.train", "--x"), module=True, max_restarts=2, job_id="j9")
    plan = make_plan(two_nodes(), job, recorded())
    assert plan.nodes[0].argv[-3:] == ("--module", "pkg.train", "--x")
    # herd restarts every node itself; torchrun's per-node restarts stay off.
    assert "--max-restarts=0" in plan.nodes[0].argv
    assert "--rdzv-id=j9" in plan.nodes[0].argv
    again = make_plan(two_nodes(), replace(job, attempt=1), recorded())
    assert all("--rdzv-id=j9-r1" in node.argv for node in again.nodes)


def test_standalone_plan_for_this_machine() -> None:
    cluster = local_cluster(nproc=2)
    plan = make_plan(
        cluster, JobSpec(entry=("t.py",), nproc=2), {"localhost": facts("localhost", [])}
    )
    (node,) = plan.nodes
    assert "--standalone" in node.argv and "--nproc-per-node=2" in node.argv
    assert plan.rdzv_endpoint is None and plan.world_size == 2


def test_c10d_on_request_tells_the_first_node_it_hosts_the_store() -> None:
    plan = make_plan(
        two_nodes(rendezvous="c10d"), JobSpec(entry=("t.py",), job_id="j1"), recorded()
    )
    first, second = plan.nodes
    assert "--rdzv-backend=c10d" in first.argv and "--rdzv-backend=c10d" in second.argv
    assert "--rdzv-conf=is_host=1" in first.argv and "--rdzv-conf=is_host=0" in second.argv
    assert not any(arg.startswith("--node-rank") for arg in first.argv + second.argv)


def test_every_job_gets_its_own_rendezvous_id() -> None:
    assert JobSpec(entry=("t.py",)).job_id != JobSpec(entry=("t.py",)).job_id


def test_dry_run_masks_secrets_by_name_and_value() -> None:
    cluster = two_nodes(env={"WANDB_API_KEY": "k-123456", "MSG": "token is s3cr3t-value", "A": "1"})
    plan = make_plan(cluster, JobSpec(entry=("t.py",)), recorded(), {"HF_TOKEN": "s3cr3t-value"})
    text = plan.render()
    assert "k-123456" not in text and "s3cr3t-value" not in text
    assert "HF_TOKEN=********" in text and "WANDB_API_KEY=********" in text and "A=1" in text
    assert "--node-rank=0" in text and "10.0.0.2" in text


def test_gpu_nodes_get_the_nccl_flight_recorder_unless_the_user_set_it() -> None:
    from torchherd.plan import GPU_EVIDENCE

    cluster = ClusterSpec(
        nodes=(NodeSpec(host="g1"), NodeSpec(host="c1")),
        env={"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
    )
    facts = {
        "g1": NodeFacts(
            host="g1",
            ssh_server_addr="10.0.0.1",
            gpu_count=2,
            port=29500,
            interfaces=(Interface("eth0", "10.0.0.1", 24),),
            env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"},
        ),
        "c1": NodeFacts(
            host="c1",
            interfaces=(Interface("eth0", "10.0.0.2", 24),),
            routes=(Route("eth0", "10.0.0.0/24"),),
        ),
    }
    plan = make_plan(cluster, JobSpec(entry=("train.py",)), facts)
    gpu, cpu = plan.nodes
    handling = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    assert gpu.env[handling] == GPU_EVIDENCE[handling]
    assert gpu.env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # the cluster's own value
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in gpu.env  # the node's own value stays
    assert handling not in cpu.env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in cpu.env


def test_nodes_alike_share_one_crowded_warning() -> None:
    """Nodes without GPUs asked for more workers than cores: those with the same numbers and
    fix share one warning, named as a hostlist; a node that differs has its own."""
    hosts = [f"n{i}" for i in range(1, 11)]
    cluster = ClusterSpec(nodes=tuple(NodeSpec(host=h) for h in hosts))
    found = {
        h: replace(facts(h, [("eth0", f"10.0.0.{i}", 24)]), cpu_count=4 if h == "n10" else 2)
        for i, h in enumerate(hosts, 1)
    }
    warnings = crowded_nodes(cluster, JobSpec(entry=("t.py",), nproc=8), found)
    assert warnings == (
        "n[1-9] (9 nodes): 8 workers on 2 CPU core(s) and no GPU: the workers will fight over "
        "the cores; fix: --nproc 2 (or fewer)",
        "n10: 8 workers on 4 CPU core(s) and no GPU: the workers will fight over the cores; "
        "fix: --nproc 4 (or fewer)",
    )


def test_lines_about_many_nodes_name_them_as_hostlists() -> None:
    """Up to SPELLED_OUT_NODES nodes, each by name (the banner, the report page, herd init);
    above, one hostlist per worker count, in the order of each count's first node."""
    from torchherd.hostlist import SPELLED_OUT_NODES, nodes_in_words

    def nodes(count: int) -> list[tuple[str, int | None]]:
        return [(f"sim{i:02d}", 4 if i == 7 else 8) for i in range(count)]

    small = nodes_in_words(nodes(SPELLED_OUT_NODES))
    assert small.startswith("sim00×8, sim01×8, ") and small.count("×") == SPELLED_OUT_NODES
    assert nodes_in_words(nodes(40)) == "sim[00-06,08-39]×8, sim07×4"
    assert nodes_in_words([("gpu1", None), ("gpu2", 4)]) == "gpu1, gpu2×4"  # count not known
    unknown = [(f"n{i}", None) for i in range(1, 11)]
    assert nodes_in_words(unknown) == "n[1-10]"
