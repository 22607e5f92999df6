"""The rendezvous store's exposure and its port: judged on every address (and again on a
restart that moves the rendezvous), probed as it binds.

Facts are recorded quick-probe answers (shape of `python -m torchherd.agent probe`) with the
addresses changed; the port tests bind real sockets on this machine.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest

from torchherd.agent import probe
from torchherd.facts import NodeFacts
from torchherd.launcher.launch import fast_preflight
from torchherd.preflight import Findings, Status, fast_checks, run_checks
from torchherd.spec import ClusterSpec, NodeSpec

QUICK_PROBE: dict[str, Any] = {
    "hostname": "node1",
    "hostname_addresses": ["127.0.1.1"],
    "ssh_server_addr": "10.185.59.11",
    "interfaces": [
        {"name": "lo", "addr": "127.0.0.1", "prefixlen": 8, "up": True, "loopback": True},
        {"name": "eth0", "addr": "10.185.59.11", "prefixlen": 24, "up": True, "loopback": False},
    ],
    "ipv6": [
        {"name": "lo", "addr": "::1", "prefixlen": 128, "loopback": True},
        {"name": "eth0", "addr": "fe80::fc00:ff:fe00:1", "prefixlen": 64, "loopback": False},
        {"name": "eth0", "addr": "fd00::2", "prefixlen": 64, "loopback": False},
    ],
    "routes": [{"iface": "eth0", "dest": "10.185.59.0/24", "gateway": "0.0.0.0", "metric": 0}],
    "python": "/usr/bin/python3",
    "python_version": "3.11.7",
    "torch_version": "2.13.0+cpu",
    "torchherd_version": "0.1.0",
    "gpu_count": 0,
    "cpu_count": 2,
    "env": {},
    "port": {"port": 29545, "free": True},
}


def facts_for(host: str, k: int, **changes: Any) -> NodeFacts:
    data = {**QUICK_PROBE, "hostname": host, "ssh_server_addr": f"10.185.59.{10 + k}"}
    data["interfaces"] = [
        QUICK_PROBE["interfaces"][0],
        {**QUICK_PROBE["interfaces"][1], "addr": f"10.185.59.{10 + k}"},
    ]
    data.update(changes)
    return NodeFacts.from_probe(host, data)


def two_nodes(**cluster: Any) -> ClusterSpec:
    return ClusterSpec(nodes=(NodeSpec(host="node1"), NodeSpec(host="node2")), **cluster)


PUBLIC_V6 = {"name": "eth1", "addr": "2a01:4f8:1:2::5", "prefixlen": 64, "loopback": False}
PUBLIC_V4 = {"name": "eth1", "addr": "11.22.33.44", "prefixlen": 24, "up": True, "loopback": False}


def exposure(results: list[Any]) -> list[Any]:
    return [r for r in results if r.check == "rendezvous" and r.status is Status.FAIL]


def test_private_addresses_only_pass() -> None:
    facts = {"node1": facts_for("node1", 1), "node2": facts_for("node2", 2)}
    assert fast_preflight(two_nodes(), facts) == []


def test_launch_refuses_a_public_ipv6_address_beside_the_private_one() -> None:
    # The plan advertises 10.185.59.11, but the store binds every interface: a global IPv6
    # address on another NIC exposes it all the same.
    node1 = facts_for("node1", 1, ipv6=[*QUICK_PROBE["ipv6"], PUBLIC_V6])
    facts = {"node1": node1, "node2": facts_for("node2", 2)}
    lines = fast_preflight(two_nodes(), facts)
    assert len(lines) == 1
    assert lines[0].startswith("node1:") and "2a01:4f8:1:2::5" in lines[0]
    assert "allow_public_rendezvous = true" in lines[0]


def test_launch_refuses_a_public_ipv4_interface_and_a_public_addr() -> None:
    node1 = facts_for("node1", 1, interfaces=[*QUICK_PROBE["interfaces"], PUBLIC_V4])
    facts = {"node1": node1, "node2": facts_for("node2", 2)}
    [failure] = exposure(fast_checks(two_nodes(), facts))
    assert failure.host == "node1" and failure.data["public"] == ["11.22.33.44"]
    # An addr the user gave counts too (a NAT'd public address is not on any interface).
    spec = ClusterSpec(nodes=(NodeSpec(host="node1", addr="8.8.4.4"), NodeSpec(host="node2")))
    facts = {"node1": facts_for("node1", 1), "node2": facts_for("node2", 2)}
    [failure] = exposure(fast_checks(spec, facts))
    assert failure.data["public"] == ["8.8.4.4"]


def test_only_the_rendezvous_node_counts_and_allowing_it_passes() -> None:
    node2 = facts_for("node2", 2, ipv6=[PUBLIC_V6])
    assert not exposure(fast_checks(two_nodes(), {"node1": facts_for("node1", 1), "node2": node2}))
    node1 = facts_for("node1", 1, ipv6=[PUBLIC_V6])
    facts = {"node1": node1, "node2": facts_for("node2", 2)}
    assert fast_preflight(two_nodes(allow_public_rendezvous=True), facts) == []


def test_the_doctor_judges_the_same_way() -> None:
    node1 = facts_for("node1", 1, ipv6=[*QUICK_PROBE["ipv6"], PUBLIC_V6])
    facts = {"node1": node1, "node2": facts_for("node2", 2)}
    results = run_checks(Findings(cluster=two_nodes(), facts=facts, full_probe=False))
    [failure] = exposure(results)
    assert failure.host == "node1" and "2a01:4f8:1:2::5" in failure.summary
    allowed = run_checks(
        Findings(cluster=two_nodes(allow_public_rendezvous=True), facts=facts, full_probe=False)
    )
    assert not exposure(allowed)


def test_probe_reports_ipv6_addresses() -> None:
    found = probe.ipv6_addresses()
    with open("/proc/net/if_inet6") as table:
        expected = len([line for line in table if line.strip()])
    assert len(found) == expected
    if found:
        assert any(a["addr"] == "::1" and a["loopback"] for a in found) or all(
            ":" in a["addr"] for a in found
        )
    facts = NodeFacts.from_probe("here", probe.collect({}))
    assert [i.addr for i in facts.ipv6] == [a["addr"] for a in found]
    assert "ipv6" not in facts.extra


# ---- the rendezvous port: probed the way the c10d store binds --------------------------------


def _free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if probe._is_free(port):
            return port


def test_a_port_in_time_wait_is_free_for_the_store() -> None:
    """A fixed rdzv_port reused right after a job: the old store's side of its connections
    lingers in TIME_WAIT, which SO_REUSEADDR (set by the store) binds over."""
    port = _free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen()
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: its end goes to TIME_WAIT
    server.close()
    time.sleep(0.2)
    client.close()
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table][1:]
    states = [row[3] for row in rows if row[1].endswith(f":{port:04X}")]
    assert "06" in states, "expected a socket in TIME_WAIT on the port"
    assert probe._is_free(port)
    assert probe.check_port(port) == {"port": port, "free": True}


@pytest.mark.parametrize(
    "family, address",
    [(socket.AF_INET, "0.0.0.0"), (socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::")],
)
def test_a_listening_port_is_busy_on_either_family(family: int, address: str) -> None:
    port = _free_port()
    try:
        listener = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        pytest.skip("no IPv6 here")
    with listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        listener.bind((address, port))
        listener.listen()
        assert not probe._is_free(port)


def test_no_preflight_does_not_skip_the_public_rendezvous_refusal() -> None:
    from torchherd.errors import NodeNotReady
    from torchherd.launcher.launch import refuse_public_rendezvous
    from torchherd.plan import JobSpec, make_plan

    cluster = two_nodes()
    facts = {
        "node1": facts_for("node1", 1, ipv6=[*QUICK_PROBE["ipv6"], PUBLIC_V6]),
        "node2": facts_for("node2", 2),
    }
    plan = make_plan(cluster, JobSpec(entry=("train.py",)), facts)
    with pytest.raises(NodeNotReady, match="2a01:4f8:1:2::5"):
        refuse_public_rendezvous(cluster, facts, plan)
    allowed = two_nodes(allow_public_rendezvous=True)
    refuse_public_rendezvous(allowed, facts, make_plan(allowed, JobSpec(entry=("t.py",)), facts))


def test_a_restart_that_moves_the_rendezvous_makes_the_check_again(tmp_path: Path) -> None:
    """--min-nodes: node1 (the rendezvous host) is lost and the job goes on on node2, whose
    address is public (a NAT'd one given as addr). The restart's plan probes node2 afresh (a
    real agent probe, run on this machine) and refuses it there, before anything starts."""
    import asyncio
    import sys

    from torchherd.errors import NodeNotReady
    from torchherd.launcher.prepare import Prepared, replan
    from torchherd.plan import JobSpec, make_plan
    from torchherd.transport.local import LocalTransport

    nodes = (NodeSpec(host="node1"), NodeSpec(host="node2", addr="8.8.4.4"))
    cluster = ClusterSpec(nodes=nodes, python=sys.executable, workdir=str(tmp_path))
    facts = {"node1": facts_for("node1", 1), "node2": facts_for("node2", 2)}
    job = JobSpec(entry=("train.py",), job_id="moved")
    prepared = Prepared(cluster, facts, {}, make_plan(cluster, job, facts))
    assert prepared.plan.nodes[0].host == "node1"  # the launch's rendezvous: private, fine
    with pytest.raises(NodeNotReady) as refused:
        asyncio.run(replan(prepared, job, LocalTransport(cluster), nodes=["node2"]))
    assert "node2: the rendezvous store would listen on public address(es) 8.8.4.4" in str(
        refused.value
    )
    assert refused.value.hosts == ("node2",)
