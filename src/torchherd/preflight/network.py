"""The doctor's conversations with the nodes, and its TCP tests between them.

Each reachable node runs one `python -m torchherd.agent net session` for the whole doctor run:
it answers the full probe with its listeners already open (an ephemeral port everywhere, the
store port on the rendezvous node), then runs the connection tests it is sent. One ssh session
per node keeps the run fast on a few nodes and gentle on sshd at hundreds.

Tests, all nodes at once with short timeouts, so a firewall that drops packets costs one
timeout, not one per node:
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..plan import LaunchPlan, NodePlan
from ..spec import ClusterSpec, NodeSpec
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
class Session:
    """One node's agent session: its process, the ports it listens on, how it ended."""

    host: str
    process: asyncio.subprocess.Process
    ports: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    returncode: int | None = None
    stderr: str = ""
    timed_out: bool = False

    @classmethod
    async def start(
        cls, cluster: ClusterSpec, transport: Transport, node: NodeSpec, request: Mapping[str, Any]
    ) -> Session:
        argv = [cluster.python_for(node), "-m", "torchherd.agent", "net", "session"]
        process = await transport.start(node, argv)
        session = cls(node.host, process)
        await session._send(request)
        return session

    async def _send(self, request: Mapping[str, Any]) -> bool:
        stdin = self.process.stdin
        if stdin is None or stdin.is_closing():
            return False
        try:
            stdin.write((json.dumps(request) + "\n").encode())
            await stdin.drain()
        except (ConnectionError, BrokenPipeError):
            return False
        return True

    async def _receive(self, timeout: float) -> dict[str, Any] | None:
        assert self.process.stdout is not None
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        except TimeoutError:
            self.timed_out = True
            await self.close()
            return None
        try:
            value = json.loads(line) if line.strip() else None
        except ValueError:
            value = None
        if value is None:
            await self.close()
        return value if isinstance(value, dict) else None

    async def hello(self, timeout: float) -> dict[str, Any] | None:
        """The probe answer (and the listening ports); None when the agent did not start."""
        answer = await self._receive(timeout)
        if answer is not None:
            self.ports = dict(answer.get("ports") or {})
            self.errors = dict(answer.get("errors") or {})
        return answer

    async def ask(self, request: Mapping[str, Any], timeout: float) -> dict[str, Any] | None:
        if not await self._send(request):
            return None
        return await self._receive(timeout)

    async def close(self) -> None:
        """Close stdin (the agent's cue to end), then collect its exit code and stderr."""
        process = self.process
        if process.stdin is not None and not process.stdin.is_closing():
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 5)
        except TimeoutError:
            process.kill()
            await process.wait()
        if process.stderr is not None and not self.stderr:
            self.stderr = (await process.stderr.read()).decode(errors="replace")
        self.returncode = process.returncode


async def network_tests(
    cluster: ClusterSpec,
    plan: LaunchPlan,
    sessions: Mapping[str, Session],
    options: NetOptions,
    say: Say | None = None,
) -> NetworkFindings:
    """Run the connection tests through the open sessions; every outcome becomes a Link."""
    say = say or (lambda _: None)
    assert plan.rdzv_endpoint is not None
    rdzv_addr, _, port_text = plan.rdzv_endpoint.rpartition(":")
    rdzv_addr = rdzv_addr.strip("[]")
    rdzv_port = int(port_text)
    rdzv = next(n for n in plan.nodes if n.is_host)
    nodes = [n for n in plan.nodes if n.host in sessions]
    listen_errors = {
        (host, name): error
        for host, session in sessions.items()
        for name, error in session.errors.items()
    }
    say("connecting between nodes")
    requests: dict[str, list[dict[str, Any]]] = {n.host: [] for n in nodes}
    store_open = "rdzv" in sessions[rdzv.host].ports
    for node in nodes:
        if store_open:
            requests[node.host].append(_target(rdzv, rdzv_addr, rdzv_port, "rdzv"))
        if options.full:
            peers = nodes
        else:
            peers = [n for n in nodes if n is not rdzv] if node is rdzv else [rdzv]
        for peer in peers:
            port = sessions[peer.host].ports.get("ephemeral")
            if peer is node or port is None:
                continue
            measure = node is rdzv and not options.full
            requests[node.host].append(
                _target(
                    peer,
                    peer.local_addr or "",
                    port,
                    "ephemeral",
                    pings=options.pings if (measure or options.full) else 0,
                    bytes=options.bytes if measure else 0,
                    seconds=options.seconds,
                )
            )
    links = await _run_checks(sessions, requests, options)
    if options.full:
        say("measuring throughput between every pair")
        links = await _pairwise_throughput(nodes, sessions, links, options)
    return NetworkFindings(
        rdzv_host=rdzv.host,
        rdzv_addr=rdzv_addr,
        rdzv_port=rdzv_port,
        links=tuple(links),
        listen_errors=listen_errors,
        full=options.full,
    )


def _target(node: NodePlan, addr: str, port: int, purpose: str, **extra: Any) -> dict[str, Any]:
    return {"name": f"{node.host}|{purpose}", "addr": addr, "port": port, **extra}


async def _run_checks(
    sessions: Mapping[str, Session], requests: dict[str, list[dict[str, Any]]], options: NetOptions
) -> list[Link]:
    async def run(host: str) -> list[Link]:
        targets = requests[host]
        if not targets:
            return []
        measured = sum(1 for t in targets if t.get("bytes"))
        budget = options.timeout * 2 + measured * (options.seconds + options.timeout + 2) + 15
        answer = await sessions[host].ask(
            {"check": {"targets": targets, "timeout": options.timeout}}, budget
        )
        results = (answer or {}).get("results")
        if not isinstance(results, list):
            why = "no answer in time" if sessions[host].timed_out else "the node's agent ended"
            results = [
                {"ok": False, "error": f"the test did not run: {why}", "reason": "error"}
                for _ in targets
            ]
        return [_link(host, t, a) for t, a in zip(targets, results, strict=False)]

    found = await asyncio.gather(*(run(host) for host in requests))
    return [link for links in found for link in links]


def _link(src: str, target: dict[str, Any], answer: dict[str, Any]) -> Link:
    dst, _, purpose = str(target["name"]).partition("|")
    return Link(
        src=src,
        dst=dst,
        addr=target["addr"],
        port=int(target["port"]),
        purpose=purpose,
        ok=bool(answer.get("ok")),
        error=str(answer.get("error", "")),
        reason=str(answer.get("reason", "")),
        connect_ms=answer.get("connect_ms"),
        rtt_ms=answer.get("rtt_ms"),
        gbits=answer.get("gbits"),
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


async def _pairwise_throughput(
    nodes: list[NodePlan], sessions: Mapping[str, Session], links: list[Link], options: NetOptions
) -> list[Link]:
    reachable = {(x.src, x.dst) for x in links if x.ok and x.purpose == "ephemeral"}
    by_host = {n.host: n for n in nodes}
    measured: dict[tuple[str, str], Link] = {}
    for pairs in round_robin([n.host for n in nodes]):
        requests: dict[str, list[dict[str, Any]]] = {}
        for a, b in pairs:
            port = sessions[b].ports.get("ephemeral")
            if (a, b) in reachable and port is not None:
                requests[a] = [
                    _target(
                        by_host[b],
                        by_host[b].local_addr or "",
                        port,
                        "ephemeral",
                        bytes=options.bytes,
                        seconds=options.seconds,
                    )
                ]
        for link in await _run_checks(sessions, requests, options):
            measured[(link.src, link.dst)] = link
    merged = []
    for link in links:
        found = measured.get((link.src, link.dst))
        if found is not None and link.purpose == "ephemeral":
            link = replace(link, gbits=found.gbits, throughput_error=found.throughput_error)
        merged.append(link)
    return merged
