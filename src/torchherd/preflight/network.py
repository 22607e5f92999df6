"""The doctor's conversations with the nodes, and its TCP tests between them.

Each reachable node runs one `python -m torchherd.agent net session` for the whole doctor run:
it answers the full probe with its listeners already open (an ephemeral port everywhere, the
store port on the rendezvous node), then runs the connection tests it is sent. One ssh session
per node keeps the run fast on a few nodes and gentle on sshd at hundreds.

Tests, all nodes at once with short timeouts, so a firewall that drops packets costs one
timeout, not one per node:
  star (default)  every node -> the store port and the rendezvous node's ephemeral port;
                  the rendezvous node -> every node's ephemeral port, with latency; then
                  throughput in the few rounds of disjoint pairs that give every node two
                  partners (`rounds.covering_rounds`): the time stays flat as nodes are added;
  full            every node -> every node (latency), then throughput for all pairs in rounds
                  of disjoint pairs (`rounds.pair_rounds`), so no two measurements share a NIC.
`measure_rounds` is the one way throughput is measured, here and in `herd bench net`.
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
from .rounds import Round, both_ways, covering_rounds, pair_rounds

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
    both_ways: bool = False
    """Measure throughput in both directions of every measured pair (a matrix, not a sample)."""


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
            requests[node.host].append(
                _target(
                    peer,
                    peer.local_addr or "",
                    port,
                    "ephemeral",
                    pings=options.pings if (node is rdzv or options.full) else 0,
                )
            )
    links = await _run_checks(sessions, requests, options)
    hosts = [n.host for n in nodes]
    rounds = pair_rounds(hosts) if options.full else covering_rounds(hosts)
    if options.both_ways:
        rounds = both_ways(rounds)
    say(f"measuring throughput in {len(rounds)} round(s) of disjoint pairs")
    links = await measure_rounds(
        nodes, sessions, links, rounds, options, lambda k, n: say(f"throughput round {k}/{n}")
    )
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


async def measure_rounds(
    nodes: list[NodePlan],
    sessions: Mapping[str, Session],
    links: list[Link],
    rounds: list[Round],
    options: NetOptions,
    on_round: Callable[[int, int], None] | None = None,
) -> list[Link]:
    """Throughput for each (sender, receiver) of ``rounds``, one round at a time, the pairs of
    a round at once. A pair already tested and found unreachable is skipped; a measured pair
    updates its link in ``links`` or, where none was tested yet, is added (with latency)."""
    tested = {(x.src, x.dst): x for x in links if x.purpose == "ephemeral"}
    by_host = {n.host: n for n in nodes}
    measured: dict[tuple[str, str], Link] = {}
    for number, pairs in enumerate(rounds, start=1):
        requests: dict[str, list[dict[str, Any]]] = {}
        for a, b in pairs:
            port = sessions[b].ports.get("ephemeral")
            known = tested.get((a, b))
            if port is None or (known is not None and not known.ok):
                continue
            requests.setdefault(a, []).append(
                _target(
                    by_host[b],
                    by_host[b].local_addr or "",
                    port,
                    "ephemeral",
                    pings=options.pings if known is None or known.rtt_ms is None else 0,
                    bytes=options.bytes,
                    seconds=options.seconds,
                )
            )
        for link in await _run_checks(sessions, requests, options):
            measured[(link.src, link.dst)] = link
        if on_round is not None:
            on_round(number, len(rounds))
    merged = []
    for link in links:
        found = measured.pop((link.src, link.dst), None) if link.purpose == "ephemeral" else None
        if found is not None:
            link = replace(link, gbits=found.gbits, throughput_error=found.throughput_error)
        merged.append(link)
    return merged + list(measured.values())
