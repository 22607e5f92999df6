"""Judging the TCP tests: the rendezvous endpoint, ephemeral ports, link speed.

A connection that fails from every other node points at the receiving node (its firewall);
one that fails from some nodes only points at the path between them. The results say which.
"""

from __future__ import annotations

import ipaddress

from ..facts import NodeFacts
from ..spec import ClusterSpec, NodeSpec
from .checks import node_plan
from .findings import Findings, PlanOutcome
from .report import CheckResult, Link, Status

EPHEMERAL_HINT = "32768-60999"


def _why(link: Link) -> str:
    if link.reason == "timeout":
        return "timed out: a firewall drops it"
    if link.reason == "refused":
        return "refused: nothing listens, or a firewall rejects it"
    return link.error or link.reason


def rendezvous(node: NodeSpec, findings: Findings, outcome: PlanOutcome) -> CheckResult:
    """On the rendezvous node: address allowed, port free, reachable; elsewhere: can connect."""
    host = node.host
    cluster = findings.cluster
    is_rdzv = node is cluster.rendezvous_node
    if host not in findings.facts:
        return CheckResult("rendezvous", host, Status.SKIP, "not probed")
    if cluster.transport == "local":
        return CheckResult("rendezvous", host, Status.SKIP, "standalone: no rendezvous store")
    if outcome.plan is None:
        if is_rdzv:
            return CheckResult("rendezvous", host, Status.FAIL, outcome.error, outcome.remedy)
        return CheckResult("rendezvous", host, Status.SKIP, "no plan: " + outcome.error)
    network = findings.network
    if is_rdzv:
        return _rendezvous_host(node, findings, outcome)
    if network is None:
        why = findings.network_skipped or "not tested"
        return CheckResult("rendezvous", host, Status.SKIP, why)
    link = next(
        (
            x
            for x in network.links
            if x.purpose == "rdzv" and x.src == host and x.dst == network.rdzv_host
        ),
        None,
    )
    if link is None:
        return CheckResult("rendezvous", host, Status.SKIP, "not tested")
    endpoint = f"{network.rdzv_host} {network.rdzv_addr}:{network.rdzv_port}"
    if link.ok:
        return CheckResult(
            "rendezvous",
            host,
            Status.PASS,
            f"connects to {endpoint} in {link.connect_ms or 0:.1f} ms",
        )
    return CheckResult(
        "rendezvous",
        host,
        Status.FAIL,
        f"cannot connect to the rendezvous store {endpoint}: {_why(link)}",
        f"open TCP port {network.rdzv_port} on {network.rdzv_host} to this node, "
        "and check the route between them",
        {"reason": link.reason},
    )


def _rendezvous_host(node: NodeSpec, findings: Findings, outcome: PlanOutcome) -> CheckResult:
    host = node.host
    cluster = findings.cluster
    facts = findings.facts[host]
    planned = node_plan(outcome, host)
    addr = planned.local_addr if planned and planned.local_addr else "?"
    assert outcome.plan is not None and outcome.plan.rdzv_endpoint
    port = int(outcome.plan.rdzv_endpoint.rsplit(":", 1)[1])
    exposed = rendezvous_exposure(cluster, node, facts, addr)
    if exposed is not None:
        return exposed
    if facts.port_free is False:
        return CheckResult(
            "rendezvous",
            host,
            Status.FAIL,
            f"port {port} is already in use here",
            "set [cluster] rdzv_port to a free port, or leave it out to let herd pick one",
        )
    network = findings.network
    if network is None:
        return CheckResult(
            "rendezvous",
            host,
            Status.SKIP if not findings.network_skipped else Status.WARN,
            findings.network_skipped or "not tested",
        )
    listen_error = network.listen_errors.get((host, "rdzv"))
    if listen_error:
        return CheckResult(
            "rendezvous",
            host,
            Status.FAIL,
            f"cannot listen on port {port} here: {listen_error}",
            "set [cluster] rdzv_port to a free port, or leave it out",
        )
    incoming = [x for x in network.links if x.purpose == "rdzv" and x.dst == host and x.src != host]
    failed = [x for x in incoming if not x.ok]
    public_addrs = public_addresses(node, facts, addr)
    public = (
        f" (public {', '.join(public_addrs)}, allowed by allow_public_rendezvous)"
        if public_addrs
        else ""
    )
    if incoming and len(failed) == len(incoming):
        return CheckResult(
            "rendezvous",
            host,
            Status.FAIL,
            f"no other node can connect to the store port {addr}:{port} here ({_why(failed[0])})",
            f"open TCP port {port} in this node's firewall to the other nodes "
            f"(e.g. `ufw allow {port}/tcp`, or an iptables ACCEPT rule)",
        )
    self_link = next(
        (x for x in network.links if x.purpose == "rdzv" and x.src == x.dst == host), None
    )
    if self_link is not None and not self_link.ok and not incoming:
        return CheckResult(
            "rendezvous",
            host,
            Status.FAIL,
            f"cannot connect to the store port {addr}:{port} from this node itself "
            f"({_why(self_link)})",
            "check the node's own firewall and routes",
        )
    status = Status.WARN if public else Status.PASS
    reached = f", reached by {len(incoming) - len(failed)} of {len(incoming)} node(s)"
    return CheckResult(
        "rendezvous",
        host,
        status,
        f"store {addr}:{port} free{public}{reached if incoming else ''}",
        "keep a firewall in front of the store port" if public else "",
    )


def _is_public(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_global
    except ValueError:
        return False


def public_addresses(node: NodeSpec, facts: NodeFacts, planned: str | None = None) -> list[str]:
    """Every global (public) address the rendezvous node's store would listen on: the c10d
    store binds all interfaces, IPv4 and IPv6, not only the address the plan advertises."""
    candidates = [a for a in (planned, node.addr) if a] + facts.addresses()
    return list(dict.fromkeys(a for a in candidates if _is_public(a)))


def rendezvous_exposure(
    cluster: ClusterSpec, node: NodeSpec, facts: NodeFacts, planned: str | None = None
) -> CheckResult | None:
    """A failure when the rendezvous node has a public address and the cluster does not allow
    it: the TCPStore has no authentication, and torch's rendezvous unpickles what is in it, so
    whoever reaches the port can run code in every agent. The doctor and every launch use this."""
    if cluster.allow_public_rendezvous:
        return None
    public = public_addresses(node, facts, planned)
    if not public:
        return None
    return CheckResult(
        "rendezvous",
        node.host,
        Status.FAIL,
        f"the rendezvous store would listen on public address(es) {', '.join(public)} "
        "(it binds every interface, and has no authentication: anyone who reaches its port "
        "can disrupt the job or run code in it)",
        "run the rendezvous on a node without a public address (list it first), or firewall "
        "the port and set allow_public_rendezvous = true in [cluster]",
        {"public": public},
    )


def ephemeral_ports(node: NodeSpec, findings: Findings) -> CheckResult:
    """NCCL and Gloo connect every pair of nodes on kernel-chosen (ephemeral) ports."""
    host = node.host
    network = findings.network
    if host not in findings.facts:
        return CheckResult("ports", host, Status.SKIP, "not probed")
    if network is None:
        return CheckResult("ports", host, Status.SKIP, findings.network_skipped or "not tested")
    listen_error = network.listen_errors.get((host, "ephemeral"))
    if listen_error:
        return CheckResult(
            "ports",
            host,
            Status.FAIL,
            f"cannot listen on a port here: {listen_error}",
            "check the node's port limits (ulimit -n, net.ipv4.ip_local_port_range)",
        )
    links = [x for x in network.links if x.purpose == "ephemeral" and x.src != x.dst]
    incoming = [x for x in links if x.dst == host]
    outgoing = [x for x in links if x.src == host]
    if not incoming and not outgoing:
        return CheckResult("ports", host, Status.SKIP, "no other node to test with")
    failed_in = [x for x in incoming if not x.ok]
    if failed_in:
        sources = ", ".join(x.src for x in failed_in)
        everyone = len(failed_in) == len(incoming) and len(incoming) > 1
        where = "no other node" if everyone else sources
        return CheckResult(
            "ports",
            host,
            Status.FAIL,
            f"{where} can connect to an ephemeral port here ({failed_in[0].port}: "
            f"{_why(failed_in[0])})",
            f"allow incoming TCP on ports {EPHEMERAL_HINT} from the other nodes "
            "(NCCL and Gloo open them between every pair)",
        )
    blocked_elsewhere = {x.dst for x in links if x.dst != host and not x.ok}
    failed_out = [x for x in outgoing if not x.ok and x.dst not in blocked_elsewhere]
    if failed_out:
        return CheckResult(
            "ports",
            host,
            Status.FAIL,
            f"cannot connect to {failed_out[0].dst}'s port {failed_out[0].port} "
            f"({_why(failed_out[0])})",
            f"check the route and firewalls between {host} and {failed_out[0].dst}",
        )
    return CheckResult(
        "ports", host, Status.PASS, f"reached from {len(incoming)}, reaches {len(outgoing)} node(s)"
    )


def link_speed(node: NodeSpec, findings: Findings) -> CheckResult:
    """The slowest measured link this node is on, against the threshold."""
    host = node.host
    network = findings.network
    if host not in findings.facts:
        return CheckResult("network", host, Status.SKIP, "not probed")
    if network is None:
        return CheckResult("network", host, Status.SKIP, findings.network_skipped or "not tested")
    mine = [x for x in network.links if host in (x.src, x.dst) and x.src != x.dst]
    errors = [x for x in mine if x.throughput_error]
    if errors:
        return CheckResult(
            "network",
            host,
            Status.WARN,
            f"throughput test {errors[0].describe()} failed: {errors[0].throughput_error}",
            "check the link with iperf3 between these nodes",
        )
    measured = [x for x in mine if x.gbits is not None]
    if not measured:
        return CheckResult("network", host, Status.SKIP, "not measured")
    worst = min(measured, key=lambda x: x.gbits or 0.0)
    gbits = worst.gbits or 0.0
    rtt = f", rtt {worst.rtt_ms:.2f} ms" if worst.rtt_ms is not None else ""
    summary = f"{worst.describe()} {gbits:.1f} Gbit/s{rtt}"
    limit = findings.limits.min_gbits
    if gbits < limit:
        return CheckResult(
            "network",
            host,
            Status.WARN,
            f"{summary} (below {limit:g} Gbit/s)",
            "check the NIC speed (ethtool), the MTU and that traffic takes the "
            "fast network (the nic column); --min-gbits sets the threshold",
            {"gbits": gbits, "rtt_ms": worst.rtt_ms},
        )
    return CheckResult(
        "network", host, Status.PASS, summary, data={"gbits": gbits, "rtt_ms": worst.rtt_ms}
    )
