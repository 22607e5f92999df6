"""Preflight checks over recorded facts: each check, its status, the node it names, its remedy.

RECORDED is a real full-probe answer from a testbed node (`agent net session`); other nodes
are copies with their own name and address. GPU facts are synthetic (no GPU here), shaped like
what nvidia-smi and the torch import report on an 8-GPU node.
"""

from __future__ import annotations

import copy
import io
import json
from typing import Any

import pytest
from rich.console import Console

from torchherd.facts import NodeFacts
from torchherd.launcher.launch import fast_preflight
from torchherd.preflight import (
    CHECKS,
    Findings,
    Limits,
    Link,
    NetworkFindings,
    ProbeFailure,
    Status,
    fast_checks,
    make_report,
    run_checks,
)
from torchherd.preflight.render import render
from torchherd.spec import ClusterSpec, NodeSpec
from torchherd.transport import Unreachable

RECORDED: dict[str, Any] = json.loads("""
{"hostname": "node1", "hostname_addresses": ["127.0.1.1"], "ssh_server_addr": "10.185.59.11",
 "interfaces": [{"name": "lo", "addr": "127.0.0.1", "prefixlen": 8, "up": true, "loopback": true},
                {"name": "eth0", "addr": "10.185.59.11", "prefixlen": 24, "up": true,
                 "loopback": false}],
 "routes": [{"iface": "eth0", "dest": "10.185.59.0/24", "gateway": "0.0.0.0", "metric": 0}],
 "python": "/root/.pyenv/versions/3.11.7/bin/python", "python_version": "3.11.7",
 "torch_version": "2.13.0+cpu", "torchherd_version": "0.1.0", "gpu_count": 0, "cpu_count": 2,
 "env": {}, "pid": 24255, "memory": {"total": 25276502016, "available": 24601964544},
 "disk": {"path": "/root", "free_bytes": 84080279552, "total_bytes": 270553174016,
          "write_mb_s": 1578.6518804385105},
 "credentials": [], "load": [1.8, 2.4, 1.8],
 "torch": {"ok": true, "version": "2.13.0+cpu", "cuda": null, "hip": null, "distributed": true,
           "gloo": true, "nccl_backend": false, "cuda_available": false, "device_count": 0,
           "devices": [], "cached": true},
 "nvidia_smi": null, "probe_seconds": 0.0188, "port": {"port": 29545, "free": true}}
""")

GPU_FACTS: dict[str, Any] = {  # synthetic: an 8-GPU node
    "gpu_count": 8,
    "torch_version": "2.5.1+cu124",
    "torch": {
        "ok": True,
        "version": "2.5.1+cu124",
        "cuda": "12.4",
        "distributed": True,
        "gloo": True,
        "nccl_backend": True,
        "nccl": "2.21.5",
        "cuda_available": True,
        "device_count": 8,
        "devices": [],
    },
    "nvidia_smi": "/usr/bin/nvidia-smi",
    "driver": "550.54.15",
    "gpus": [
        {
            "index": i,
            "uuid": f"GPU-{i}",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_mib": 81559,
            "memory_used_mib": 0,
            "utilization": 0,
        }
        for i in range(8)
    ],
    "gpu_processes": [],
}


def recorded(host: str, k: int, **changes: Any) -> NodeFacts:
    data = copy.deepcopy(RECORDED)
    addr = f"10.185.59.{10 + k}"
    data["hostname"] = host
    data["ssh_server_addr"] = addr
    data["interfaces"][1]["addr"] = addr
    if k != 1:
        data.pop("port")
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return NodeFacts.from_probe(host, data)


def cluster(n: int = 4, **extra: Any) -> ClusterSpec:
    nodes = extra.pop("nodes", None) or tuple(NodeSpec(host=f"node{k}") for k in range(1, n + 1))
    return ClusterSpec(nodes=nodes, source="test", **extra)


def healthy_links(hosts: list[str], gbits: float = 14.0) -> tuple[Link, ...]:
    """What the star tests find on a healthy cluster (node1 hosts the store on 29545)."""
    links = []
    for k, host in enumerate(hosts, start=1):
        links.append(Link(host, "node1", "10.185.59.11", 29545, "rdzv", True, connect_ms=1.0))
        if host != "node1":
            links.append(Link(host, "node1", "10.185.59.11", 40000, "ephemeral", True))
            links.append(
                Link(
                    "node1",
                    host,
                    f"10.185.59.{10 + k}",
                    40000 + k,
                    "ephemeral",
                    True,
                    rtt_ms=0.03,
                    gbits=gbits,
                )
            )
    return tuple(links)


def findings(
    n: int = 4,
    *,
    links: tuple[Link, ...] | None = None,
    facts: dict[str, NodeFacts] | None = None,
    **extra: Any,
) -> Findings:
    spec = extra.pop("cluster", None) or cluster(n)
    hosts = [node.host for node in spec.nodes]
    all_facts = {h: recorded(h, k) for k, h in enumerate(hosts, start=1)}
    all_facts.update(facts or {})
    for host in list(extra.get("unreachable", {})) + list(extra.get("probe_failures", {})):
        all_facts.pop(host, None)
    network = NetworkFindings(
        "node1",
        "10.185.59.11",
        29545,
        links if links is not None else healthy_links(list(all_facts)),
    )
    return Findings(cluster=spec, facts=all_facts, network=network, **extra)


def by(results: list[Any], check: str) -> dict[str | None, Any]:
    return {r.host: r for r in results if r.check == check}


def test_healthy_cluster_passes_with_a_hostname_warning() -> None:
    results = run_checks(findings())
    assert {r.check for r in results} == {c.id for c in CHECKS if not c.optional}
    problems = [r for r in results if r.status in (Status.FAIL, Status.WARN)]
    assert {r.check for r in problems} == {"hostname"}
    name = by(results, "hostname")["node2"]
    assert "127.0.1.1" in name.summary and "--local-addr=10.185.59.12" in name.summary
    assert "MASTER_ADDR" in name.summary
    report = make_report(findings())
    assert report.exit_code == 0 and not report.failed
    json.dumps(report.to_dict())  # --json must be serialisable


def test_unreachable_node_fails_ssh_and_skips_the_rest() -> None:
    lost = Unreachable("node3", "timeout", "Connection timed out", "node3 did not answer")
    results = run_checks(findings(unreachable={"node3": lost}))
    assert by(results, "ssh")["node3"].status is Status.FAIL
    assert "timed out" in by(results, "ssh")["node3"].summary
    assert by(results, "python")["node3"].status is Status.SKIP
    assert by(results, "ssh")["node2"].status is Status.PASS
    assert make_report(findings(unreachable={"node3": lost})).exit_code == 3


def test_python_without_torchherd_and_torch() -> None:
    failure = ProbeFailure(
        "node2",
        "/usr/bin/python3",
        "no-torchherd",
        "No module named torchherd",
        python_version="3.11.2",
        has_torch=False,
    )
    results = run_checks(findings(probe_failures={"node2": failure}))
    python = by(results, "python")["node2"]
    assert python.status is Status.FAIL
    assert python.summary == (
        "torchherd and torch are not installed for /usr/bin/python3 (Python 3.11.2)"
    )
    assert "pip install torchherd torch" in python.remedy
    assert by(results, "torch")["node2"].status is Status.FAIL


@pytest.mark.parametrize(
    "kind,words",
    [("no-python", "not found"), ("old-python", "needs 3.11"), ("timeout", "did not answer")],
)
def test_probe_failures_are_explained(kind: str, words: str) -> None:
    failure = ProbeFailure("node2", "/opt/py", kind, "detail", python_version="3.8.10")
    python = by(run_checks(findings(probe_failures={"node2": failure})), "python")["node2"]
    assert python.status is Status.FAIL and words in python.summary and python.remedy


def test_torch_missing_broken_or_blind_to_the_gpus() -> None:
    missing = recorded("node2", 2, torch_version=None, torch={"ok": False, "error": "No module"})
    broken = recorded("node3", 3, torch={"ok": False, "error": "OSError: libcudnn.so.9"})
    blind = recorded(
        "node4",
        4,
        **{
            **GPU_FACTS,
            "torch": {
                "ok": True,
                "version": "2.13.0+cpu",
                "cuda": None,
                "distributed": True,
                "cuda_available": False,
            },
        },
    )
    results = by(
        run_checks(findings(facts={"node2": missing, "node3": broken, "node4": blind})), "torch"
    )
    assert "torch is not installed for" in results["node2"].summary
    assert "does not import: OSError: libcudnn.so.9" in results["node3"].summary
    assert "cannot use them" in results["node4"].summary and "CPU-only" in results["node4"].summary
    assert all(results[h].status is Status.FAIL for h in ("node2", "node3", "node4"))


def test_versions_name_the_odd_node_and_tabulate_the_difference() -> None:
    odd = recorded("node3", 3, torchherd_version="0.1.0.post1")
    f = findings(facts={"node3": odd})
    versions = by(run_checks(f), "versions")
    assert versions["node3"].status is Status.FAIL
    assert versions["node3"].summary == "torchherd 0.1.0.post1 here, 0.1.0 on node1, node2, node4"
    assert versions["node1"].status is Status.PASS
    assert make_report(f).versions == {
        "torchherd": {"node1": "0.1.0", "node2": "0.1.0", "node3": "0.1.0.post1", "node4": "0.1.0"}
    }


def test_torchft_counts_where_it_is_installed() -> None:
    f = findings(
        3,
        facts={
            "node1": recorded("node1", 1, torchft_version="0.2.0"),
            "node2": recorded("node2", 2, torchft_version="0.2.0"),
            "node3": recorded("node3", 3, torchft_version="0.3.0"),
        },
    )
    versions = by(run_checks(f), "versions")
    assert versions["node3"].summary == "torchft 0.3.0 here, 0.2.0 on node1, node2"
    assert versions["node1"].status is Status.PASS
    # A node without torchft is not a version difference (launch --replica-groups says so).
    f = findings(2, facts={"node1": recorded("node1", 1, torchft_version="0.2.0")})
    assert by(run_checks(f), "versions")["node2"].status is Status.PASS


def test_versions_tie_goes_to_the_rendezvous_node_and_cuda_nccl_count() -> None:
    gpu = {**GPU_FACTS, "torch": {**GPU_FACTS["torch"], "nccl": "2.20.5"}}
    f = findings(
        2, facts={"node1": recorded("node1", 1, **GPU_FACTS), "node2": recorded("node2", 2, **gpu)}
    )
    versions = by(run_checks(f), "versions")
    assert versions["node1"].status is Status.PASS
    assert versions["node2"].summary == "nccl 2.20.5 here, 2.21.5 on node1"


def test_python_minor_counts_but_patch_does_not() -> None:
    f = findings(
        3,
        facts={
            "node2": recorded("node2", 2, python_version="3.11.2"),
            "node3": recorded("node3", 3, python_version="3.12.1"),
        },
    )
    versions = by(run_checks(f), "versions")
    assert versions["node2"].status is Status.PASS
    assert versions["node3"].summary == "python 3.12 here, 3.11 on node1, node2"


def test_launcher_version_differing_alone_is_a_warning() -> None:
    f = findings(2, launcher_version="0.2.0")
    versions = by(run_checks(f), "versions")
    assert (
        versions["node1"].status is Status.WARN
        and "0.2.0 on this launcher" in versions["node1"].summary
    )


def test_workers_beyond_gpus_fail_beyond_cores_warn() -> None:
    spec = cluster(nodes=(NodeSpec(host="node1", nproc=9), NodeSpec(host="node2", nproc=5)))
    f = findings(cluster=spec, facts={"node1": recorded("node1", 1, **GPU_FACTS)})
    workers = by(run_checks(f), "workers")
    assert workers["node1"].status is Status.FAIL
    assert "9 workers" in workers["node1"].summary and "8 GPU(s)" in workers["node1"].summary
    assert workers["node2"].status is Status.WARN
    assert "5 workers" in workers["node2"].summary and "2 CPU core(s)" in workers["node2"].summary
    assert workers["node2"].remedy == "set nproc = 2 (or fewer) for node2 in test"
    assert by(run_checks(findings(2, nproc=2)), "workers")["node1"].status is Status.PASS


def test_too_many_workers_from_the_command_line_are_fixed_on_the_command_line() -> None:
    # `herd doctor --nproc 5` (or launch's): the fix is the option given, not a cluster file key.
    crowded = by(run_checks(findings(2, nproc=5)), "workers")["node1"]
    assert crowded.status is Status.WARN
    assert crowded.remedy == "use --nproc 2 (or fewer)"


def test_busy_gpus_warn_only_for_visible_ones() -> None:
    busy = {
        **GPU_FACTS,
        "gpu_processes": [{"gpu_uuid": "GPU-3", "pid": 4242, "name": "python", "used_mib": 20000}],
    }
    f = findings(2, facts={"node1": recorded("node1", 1, **busy)})
    gpus = by(run_checks(f), "gpus")
    assert gpus["node1"].status is Status.WARN and "pid 4242" in gpus["node1"].summary
    assert gpus["node2"].status is Status.SKIP  # a CPU node
    hidden = recorded("node1", 1, **busy, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert (
        by(run_checks(findings(2, facts={"node1": hidden})), "gpus")["node1"].status is Status.PASS
    )


def test_nic_on_a_docker_bridge_warns_and_a_wrong_ifname_fails() -> None:
    docker = recorded(
        "node2",
        2,
        interfaces=[
            {"name": "lo", "addr": "127.0.0.1", "prefixlen": 8, "up": True, "loopback": True},
            {
                "name": "docker0",
                "addr": "10.185.59.12",
                "prefixlen": 24,
                "up": True,
                "loopback": False,
            },
        ],
        routes=[{"iface": "docker0", "dest": "10.185.59.0/24", "gateway": "0.0.0.0", "metric": 0}],
    )
    wrong = recorded("node3", 3, env={"NCCL_SOCKET_IFNAME": "ib0"})
    nic = by(run_checks(findings(facts={"node2": docker, "node3": wrong})), "nic")
    assert nic["node2"].status is Status.WARN and "docker0" in nic["node2"].summary
    assert nic["node3"].status is Status.FAIL and "NCCL_SOCKET_IFNAME=ib0" in nic["node3"].summary
    assert nic["node1"].status is Status.PASS and nic["node1"].summary == "eth0 10.185.59.11"


def test_no_route_to_the_rendezvous_address_fails_that_node_only() -> None:
    island = recorded(
        "node3",
        3,
        interfaces=[
            {"name": "lo", "addr": "127.0.0.1", "prefixlen": 8, "up": True, "loopback": True},
            {"name": "eth0", "addr": "192.168.9.3", "prefixlen": 24, "up": True, "loopback": False},
        ],
        routes=[{"iface": "eth0", "dest": "192.168.9.0/24", "gateway": "0.0.0.0", "metric": 0}],
    )
    nic = by(run_checks(findings(facts={"node3": island})), "nic")
    assert nic["node3"].status is Status.FAIL and "no route" in nic["node3"].summary
    assert nic["node2"].status is Status.PASS


def test_public_rendezvous_address_fails_unless_allowed() -> None:
    public = {
        "ssh_server_addr": "8.8.4.4",
        "interfaces": [
            {"name": "eth0", "addr": "8.8.4.4", "prefixlen": 24, "up": True, "loopback": False}
        ],
    }
    facts = {"node1": recorded("node1", 1, **public)}
    rdzv = by(run_checks(findings(2, facts=facts, links=())), "rendezvous")["node1"]
    assert rdzv.status is Status.FAIL and "no authentication" in rdzv.summary
    assert "allow_public_rendezvous" in rdzv.remedy
    allowed = findings(2, facts=facts, links=(), cluster=cluster(2, allow_public_rendezvous=True))
    assert by(run_checks(allowed), "rendezvous")["node1"].status is Status.WARN


def test_blocked_store_port_blames_the_rendezvous_node() -> None:
    links = tuple(
        link
        if link.purpose != "rdzv" or link.src == "node1"
        else Link(link.src, "node1", link.addr, 29545, "rdzv", False, "timed out", "timeout")
        for link in healthy_links(["node1", "node2", "node3", "node4"])
    )
    rdzv = by(run_checks(findings(links=links)), "rendezvous")
    assert rdzv["node1"].status is Status.FAIL
    assert "no other node can connect to the store port 10.185.59.11:29545" in rdzv["node1"].summary
    assert "firewall" in rdzv["node1"].remedy and "29545" in rdzv["node1"].remedy
    assert rdzv["node2"].status is Status.FAIL and "timed out" in rdzv["node2"].summary


def test_store_port_in_use_fails() -> None:
    used = recorded("node1", 1, port={"port": 29545, "free": False})
    rdzv = by(run_checks(findings(facts={"node1": used})), "rendezvous")["node1"]
    assert rdzv.status is Status.FAIL and "in use" in rdzv.summary


def test_ephemeral_port_firewall_is_placed_on_the_receiving_node() -> None:
    links = tuple(
        Link(x.src, x.dst, x.addr, x.port, x.purpose, False, "timed out", "timeout")
        if x.purpose == "ephemeral" and x.dst == "node3"
        else x
        for x in healthy_links(["node1", "node2", "node3", "node4"])
    )
    ports = by(run_checks(findings(links=links)), "ports")
    assert ports["node3"].status is Status.FAIL
    assert "node1 can connect to an ephemeral port here" in ports["node3"].summary
    assert "32768-60999" in ports["node3"].remedy
    assert ports["node1"].status is Status.PASS  # its outgoing failure is node3's doing
    assert ports["node2"].status is Status.PASS


def test_slow_link_warns_and_names_the_link() -> None:
    links = tuple(
        Link(**{**x.__dict__, "gbits": 0.94}) if x.dst == "node4" and x.gbits else x
        for x in healthy_links(["node1", "node2", "node3", "node4"])
    )
    f = findings(links=links, limits=Limits(min_gbits=10))
    net = by(run_checks(f), "network")
    assert net["node4"].status is Status.WARN
    assert net["node4"].summary.startswith("node1 -> node4 0.9 Gbit/s")
    # Both ends of the slow link warn (either may be the cause); the others pass.
    assert net["node1"].status is Status.WARN and net["node2"].status is Status.PASS
    slowest = make_report(f).slowest_link()
    assert slowest is not None and slowest.dst == "node4"


def test_disk_and_credentials() -> None:
    low = recorded("node2", 2, disk={"free_bytes": 5 * 10**8})
    tight = recorded("node3", 3, disk={"free_bytes": 4 * 10**9})
    leaky = recorded(
        "node4",
        4,
        credentials=[
            {
                "path": "~/.passwd-s3fs",
                "mode": "0644",
                "group_readable": True,
                "other_readable": True,
            },
            {"path": "~/.netrc", "mode": "0600", "group_readable": False, "other_readable": False},
        ],
    )
    results = run_checks(findings(facts={"node2": low, "node3": tight, "node4": leaky}))
    disk = by(results, "disk")
    assert disk["node2"].status is Status.FAIL and disk["node3"].status is Status.WARN
    creds = by(results, "credentials")["node4"]
    assert creds.status is Status.WARN and creds.remedy == "chmod 600 ~/.passwd-s3fs"
    assert "s3fs refuses" in creds.summary


def test_fast_checks_keep_launchs_problem_lines() -> None:
    spec = cluster(3, workdir="/srv/job")
    facts = {
        "node1": recorded(
            "node1", 1, port={"port": 29545, "free": False}, workdir="/srv/job", workdir_exists=True
        ),
        "node2": recorded("node2", 2, torch_version=None, workdir="/srv/job", workdir_exists=True),
        "node3": recorded(
            "node3", 3, torchherd_version="0.0.9", workdir="/srv/job", workdir_exists=False
        ),
    }
    for facts_ in facts.values():
        facts_.extra.pop("torch", None)  # a quick probe has no torch import
    lines = fast_preflight(spec, facts)
    assert [line.split(":", 1)[0] for line in lines] == ["node2", "node3", "node3", "node1"]
    assert any("torch is not installed" in line for line in lines)
    assert any("does not exist" in line and "fix: `herd sync`" in line for line in lines)
    assert any("torchherd 0.0.9 here" in line for line in lines)
    assert any("port 29545 is in use" in line for line in lines)
    assert all(r.status is not Status.WARN for r in fast_checks(spec, facts))


def test_render_groups_the_same_remedy() -> None:
    buffer = io.StringIO()
    report = make_report(findings(), seconds=1.5)
    render(report, Console(file=buffer, width=80, color_system=None))
    text = buffer.getvalue()
    assert "node1" in text and "rdzv" in text and "What to do" in text
    assert "also on node2, node3, node4" in text
    assert text.count("fix:") == 1
    assert "All 4 node(s) ready (4 warning(s))" in text


def test_fast_checks_refuse_a_script_or_module_missing_on_a_node() -> None:
    spec = cluster(3, workdir="/srv/job")
    here = {"workdir": "/srv/job", "workdir_exists": True}
    facts = {
        "node1": recorded(
            "node1",
            1,
            **here,
            entry={"script": "train.py", "path": "/srv/job/train.py", "found": True},
        ),
        "node2": recorded(
            "node2",
            2,
            **here,
            entry={"script": "train.py", "path": "/srv/job/train.py", "found": False},
        ),
        "node3": recorded("node3", 3, **here, entry={"module": "mypkg.train", "found": False}),
    }
    results = by(fast_checks(spec, facts), "entry")
    assert results["node1"].status is Status.PASS
    assert results["node2"].status is Status.FAIL
    assert "script train.py not found in /srv/job" in results["node2"].summary
    assert "herd sync" in results["node2"].remedy and "workdir" in results["node2"].remedy
    assert results["node3"].status is Status.FAIL
    assert "module mypkg.train is not importable" in results["node3"].summary
    lines = fast_preflight(spec, facts)
    assert [line.split(":", 1)[0] for line in lines] == ["node2", "node3"]
    # A missing workdir is said once, by the workdir check, not again for the script.
    facts["node2"] = recorded(
        "node2", 2, workdir="/srv/job", workdir_exists=False, entry=facts["node2"].entry
    )
    assert by(fast_checks(spec, facts), "entry")["node2"].status is Status.SKIP


def test_the_tables_headers_are_whole_at_80_columns() -> None:
    """On an 80-column terminal every check's header is shown in full; a long node name is
    what gives way."""
    from torchherd.preflight import CHECKS

    buffer = io.StringIO()
    long_names = tuple(NodeSpec(host=f"alice@gpu-node-000{k}.cluster.example.org") for k in (1, 2))
    report = make_report(findings(cluster=cluster(nodes=long_names)), seconds=1.5)
    render(report, Console(file=buffer, width=80, color_system=None))
    header = buffer.getvalue().splitlines()[0].split()
    assert header == ["node", *(c.header for c in CHECKS if not c.optional)], header
    assert all(len(line) <= 80 for line in buffer.getvalue().splitlines())
