"""The doctor's TCP tests, driven from the launcher through the transport (no traffic of its own).

Listeners first: every node opens an ephemeral port, the rendezvous node also the store port the
plan chose. Then connections, all nodes at once with short timeouts, so a firewall that drops
packets costs one timeout, not one per node:
  star (default)  every node -> the store port and the rendezvous node's ephemeral port;
                  the rendezvous node -> every node's ephemeral port, with latency and, one
                  link at a time, throughput;
  full            every node -> every node (latency), then throughput for all pairs in rounds
                  of disjoint pairs, so no two measurements share a NIC.
Addresses are the plan's (``--local-addr`` of each node): what torchrun, NCCL and Gloo will use.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..plan import LaunchPlan, NodePlan
from ..spec import ClusterSpec
from ..transport import Transport
from .findings import NetworkFindings
from .report import Link

Say = Callable[[str], None]


@dataclass(frozen=True)
class NetOptions:
    timeout: float = 2.5
    """Seconds a TCP connection may take before the port counts as blocked."""
    pings: int = 5
    """Round trips per link for the latency figure (median)."""
    bytes: int = 256 << 20
    """Most bytes sent per throughput test."""
    seconds: float = 1.0
    """Longest throughput test per link."""
    full: bool = False
    """Test every pair of nodes, not only the star around the rendezvous node."""


@dataclass
class _Server:
    host: str
    process: asyncio.subprocess.Process | None
    ports: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


async def network_tests(
    cluster: ClusterSpec,
    transport: Transport,
    plan: LaunchPlan,
    options: NetOptions,
    say: Say | None = None,
) -> NetworkFindings:
    """Run the listeners and connections; every outcome becomes a Link."""
    say = say or (lambda _: None)
    assert plan.rdzv_endpoint is not None
    rdzv_addr, _, port_text = plan.rdzv_endpoint.rpartition(":")
    rdzv_addr = rdzv_addr.strip("[]")
    rdzv_port = int(port_text)
    rdzv = next(n for n in plan.nodes if n.is_host)
    by_host = {n.host: n for n in plan.nodes}

    say("opening test ports on every node")

    async def start(node: NodePlan) -> _Server:
        ports = {"ephemeral": 0, **({"rdzv": rdzv_port} if node.is_host else {})}
        return await _serve(cluster, transport, node.host, ports)

    servers = {s.host: s for s in await asyncio.gather(*(start(n) for n in plan.nodes))}
    try:
        listen_errors = {(host, name): error for host, server in servers.items()
                         for name, error in server.errors.items()}
        say("connecting between nodes")
        requests: dict[str, list[dict[str, Any]]] = {n.host: [] for n in plan.nodes}
        for node in plan.nodes:
            if "rdzv" in servers[rdzv.host].ports:
                requests[node.host].append(_target(rdzv, rdzv_addr, rdzv_port, "rdzv"))
            peers = plan.nodes if options.full else (
                [n for n in plan.nodes if n is not rdzv] if node is rdzv else [rdzv])
            for peer in peers:
                port = servers[peer.host].ports.get("ephemeral")
                if peer is node or port is None:
                    continue
                measure = node is rdzv and not options.full
                requests[node.host].append(_target(
                    peer, by_host[peer.host].local_addr or "", port, "ephemeral",
                    pings=options.pings if (measure or options.full) else 0,
                    bytes=options.bytes if measure else 0, seconds=options.seconds))
        links = await _run_checks(cluster, transport, requests, options)
        if options.full:
            say("measuring throughput between every pair")
            links = await _pairwise_throughput(cluster, transport, plan, servers, links, options)
    finally:
        await asyncio.gather(*(_stop(server) for server in servers.values()))
    return NetworkFindings(rdzv_host=rdzv.host, rdzv_addr=rdzv_addr, rdzv_port=rdzv_port,
                           links=tuple(links), listen_errors=listen_errors, full=options.full)


def _target(node: NodePlan, addr: str, port: int, purpose: str, **extra: Any) -> dict[str, Any]:
    return {"name": f"{node.host}|{purpose}", "addr": addr, "port": port, **extra}


async def _serve(cluster: ClusterSpec, transport: Transport, host: str,
                 ports: dict[str, int]) -> _Server:
    node = cluster.node(host)
    argv = [cluster.python_for(node), "-m", "torchherd.agent", "net", "serve"]
    try:
        process = await transport.start(node, argv)
    except OSError as exc:
        return _Server(host, None, errors={name: str(exc) for name in ports})
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write((json.dumps({"ports": ports}) + "\n").encode())
    await process.stdin.drain()
    try:
        line = await asyncio.wait_for(process.stdout.readline(), cluster.connect_timeout + 15)
        answer = json.loads(line)
        return _Server(host, process, dict(answer["ports"]), dict(answer["errors"]))
    except (TimeoutError, ValueError, KeyError) as exc:
        server = _Server(host, process)
        await _stop(server)
        err = b""
        if process.stderr is not None:
            err = await process.stderr.read()
        why = err.decode(errors="replace").strip().splitlines()[-1:] or [type(exc).__name__]
        server.errors = {name: f"the test listener did not start: {why[0]}" for name in ports}
        return server


async def _stop(server: _Server) -> None:
    process = server.process
    if process is None or process.returncode is not None:
        return
    if process.stdin is not None and not process.stdin.is_closing():
        process.stdin.close()  # the listener's cue to end
    try:
        await asyncio.wait_for(process.wait(), 5)
    except TimeoutError:
        process.kill()
        await process.wait()


async def _run_checks(cluster: ClusterSpec, transport: Transport,
                      requests: dict[str, list[dict[str, Any]]],
                      options: NetOptions) -> list[Link]:
    async def run(host: str) -> list[Link]:
        targets = requests[host]
        if not targets:
            return []
        node = cluster.node(host)
        measured = sum(1 for t in targets if t.get("bytes"))
        budget = options.timeout * 2 + measured * (options.seconds + options.timeout + 2) + 15
        result = await transport.run(
            node, [cluster.python_for(node), "-m", "torchherd.agent", "net", "check"],
            input=(json.dumps({"targets": targets, "timeout": options.timeout}) + "\n").encode(),
            timeout=budget + cluster.connect_timeout,
        )
        try:
            answers = json.loads(result.stdout)["results"]
        except (ValueError, KeyError):
            why = result.stderr.strip().splitlines()[-1:] or ["no answer"]
            if result.timed_out:
                why = [f"no answer within {budget:.0f} s"]
            answers = [{"ok": False, "error": f"the test did not run: {why[0]}", "reason": "error"}
                       for _ in targets]
        return [_link(host, t, a) for t, a in zip(targets, answers, strict=False)]

    found = await asyncio.gather(*(run(host) for host in requests))
    return [link for links in found for link in links]


def _link(src: str, target: dict[str, Any], answer: dict[str, Any]) -> Link:
    dst, _, purpose = str(target["name"]).partition("|")
    return Link(
        src=src, dst=dst, addr=target["addr"], port=int(target["port"]), purpose=purpose,
        ok=bool(answer.get("ok")), error=str(answer.get("error", "")),
        reason=str(answer.get("reason", "")), connect_ms=answer.get("connect_ms"),
        rtt_ms=answer.get("rtt_ms"), gbits=answer.get("gbits"),
        throughput_error=str(answer.get("throughput_error", "")),
    )


def round_robin(hosts: list[str]) -> list[list[tuple[str, str]]]:
    """Rounds of disjoint pairs covering every pair once (the circle method)."""
    ring: list[str | None] = list(hosts) + ([None] if len(hosts) % 2 else [])
    rounds = []
    for _ in range(len(ring) - 1):
        half = len(ring) // 2
        pairs = [(ring[i], ring[-1 - i]) for i in range(half)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return rounds


async def _pairwise_throughput(cluster: ClusterSpec, transport: Transport, plan: LaunchPlan,
                               servers: dict[str, _Server], links: list[Link],
                               options: NetOptions) -> list[Link]:
    reachable = {(x.src, x.dst) for x in links if x.ok and x.purpose == "ephemeral"}
    by_host = {n.host: n for n in plan.nodes}
    measured: dict[tuple[str, str], Link] = {}
    for pairs in round_robin([n.host for n in plan.nodes]):
        requests: dict[str, list[dict[str, Any]]] = {}
        for a, b in pairs:
            port = servers[b].ports.get("ephemeral")
            if (a, b) in reachable and port is not None:
                requests[a] = [_target(by_host[b], by_host[b].local_addr or "", port, "ephemeral",
                                       bytes=options.bytes, seconds=options.seconds)]
        for link in await _run_checks(cluster, transport, requests, options):
            measured[(link.src, link.dst)] = link
    merged = []
    for link in links:
        found = measured.get((link.src, link.dst))
        if found is not None and link.purpose == "ephemeral":
            link = Link(**{**link.__dict__, "gbits": found.gbits,
                           "throughput_error": found.throughput_error})
        merged.append(link)
    return merged
