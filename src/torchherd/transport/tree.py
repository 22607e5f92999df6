"""A tree of nodes: the launcher connects to a few inner nodes, they start the rest.

Over flat ssh every node costs the launching machine an ssh connection (a key exchange, ~75 ms
of CPU with OpenSSH's default post-quantum one) and an ssh client per command. Above
``[cluster] tree_above`` nodes (``herd launch --tree-above N``) herd opens ssh connections to
a few inner nodes only, one for every SUBTREE + 1 nodes (1 inner node up to 33 nodes, 31 for
1,000), each starting a subtree of at most SUBTREE other nodes (in turn). The inner nodes are
the last ones of the cluster: the first is node rank 0, whose torchrun hosts the rendezvous
store everyone waits for, so it is not also the one running a subtree's ssh clients. (Not
sqrt(N), and not a second inner node for safety: the launcher's cost is a key exchange per
inner node, an inner node starts its subtree's ssh sessions in parallel, and an inner node
that cannot be reached only sends its subtree back to flat ssh, below.)

herd's agent commands on a subtree's nodes, started together, become one ssh session to the
inner node, running the fan-out (agent/fanout.py), which starts over its own ssh the relay
(agent/relay.py) on each of them; each relay dials straight back to this launcher, as under
Slurm (transport/relay.py), says which node it is with the launcher's token, receives its
command, and leaves the session that started it. So:

- the launcher holds O(N / SUBTREE) ssh connections and clients, and one TCP link per node;
- an inner node carries nothing once its subtree has connected: losing it is a node loss for
  it alone (its own agent runs over its own ssh session, as under flat ssh), while its
  subtree's links, which never went through it, go on;
- events and lines travel each node's own link, batched by its agent as over ssh.

Where an inner node cannot reach a node of its subtree (its own ssh keys or config do not get
there, or that node cannot dial the launcher at the address the inner node saw), and where an
inner node itself is unreachable, that node is reached directly instead, as flat ssh would,
and ``herd launch -v`` says so with ssh's reason. Other commands (``herd exec``'s) run over
flat ssh, with a connection opened on first use.

The tree asks of its transport only what TreeHost names (how to reach an inner node, what an
inner node runs to reach another, the address a relay dials): over ssh that is SshTransport;
the simulated cluster of the tests and benchmarks (tests/simcluster) runs the same tree with
local processes where ssh would run, so a 1,000-node simulated launch goes through it.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol

from ..agent.relay import (
    BATCH_VAR,
    CANNOT_CONNECT,
    DETACH_VAR,
    HOST_VAR,
    NODE_VAR,
    PORT_VAR,
)
from ..spec import ClusterSpec, NodeSpec
from .base import Command, Unreachable, agent_verb
from .relay import (
    RelayedProcess,
    RelayServer,
    StepBatch,
    StepGatherer,
    relay_link_failure,
)

RELAY_MODULE = "torchherd.agent.relay"
FANOUT_MODULE = "torchherd.agent.fanout"
# Nodes an inner node starts (its fan-out runs their ssh clients in parallel).
SUBTREE = 32
# ssh's exit code for its own failures.
SSH_ERROR = 255
# Seconds a fan-out left at the launcher's end gets to end by itself before its ssh is ended.
FANOUT_END_GRACE = 1.0
_LABEL = re.compile(r"^\s*\d+: ?")


def inner_count(nodes: int) -> int:
    """How many inner nodes a tree of ``nodes`` nodes has: enough for subtrees of at most
    SUBTREE nodes. One suffices up to SUBTREE + 1 nodes: a second would cost the launcher a
    key exchange on every launch to save one (flat ssh's) only when the first is down."""
    return max(1, math.ceil(nodes / (SUBTREE + 1)))


def shape(hosts: list[str]) -> dict[str, str]:
    """host -> the inner node whose subtree it is in (inner nodes map to themselves): the
    last inner_count(N) hosts are inner (the first is node rank 0, the rendezvous host), the
    others go to them in turn."""
    count = inner_count(len(hosts))
    inner = hosts[-count:]
    parents = {host: host for host in inner}
    for index, host in enumerate(hosts[:-count]):
        parents[host] = inner[index % count]
    return parents


class TreeHost(Protocol):
    """What a tree needs of the transport that reaches its inner nodes (over ssh:
    SshTransport; on the simulated cluster of the tests and benchmarks, its own)."""

    cluster: ClusterSpec
    relay_address: str
    """How a subtree's relay names the launcher's address (HERD_RELAY_HOST's value)."""

    def connected(self, host: str) -> bool:
        """Whether this launcher holds a link to ``host`` now."""

    def shell_line(
        self,
        node: NodeSpec,
        command: Command,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str: ...

    def onward_argv(self, node: NodeSpec, line: str) -> list[str]:
        """What an inner node runs to run ``line`` on ``node`` (its own ssh to it); the line
        comes last (the fan-out puts the launcher's address in it)."""

    async def start_flat(
        self,
        node: NodeSpec,
        command: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> asyncio.subprocess.Process:
        """A command over this launcher's own link to the node."""

    async def connect_direct(self, node: NodeSpec) -> Unreachable | None:
        """Open this launcher's own link to the node; None when it is up, else why not."""


class NodeTree:
    """The tree of one transport: which node is reached through which inner node."""

    def __init__(self, transport: TreeHost) -> None:
        self.transport = transport
        self.parent = shape([node.host for node in transport.cluster.nodes])
        self.inner = [host for host, parent in self.parent.items() if host == parent]
        self.down: set[str] = set()
        """Inner nodes that could not be reached, or could not run the fan-out."""
        self.routes: dict[str, str] = {}
        """host -> the inner node it was reached through."""
        self.direct: dict[str, str] = {}
        """host -> why it was reached directly instead."""
        self._steps = StepGatherer(RelayServer(), self._start_fanout, self._settle)
        self._count = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def is_inner(self, node: NodeSpec) -> bool:
        return self.parent.get(node.host) == node.host

    def inner_for(self, node: NodeSpec) -> str | None:
        """The inner node to start ``node``'s command through: its own, else another that is
        up, else None (then it is reached directly)."""
        mine = self.parent.get(node.host)
        if mine is None or mine == node.host:
            return None
        reach = self.transport
        up = [host for host in self.inner if host not in self.down and reach.connected(host)]
        if not up:
            return None
        return mine if mine in up else up[self.inner.index(mine) % len(up)]

    async def start(
        self,
        node: NodeSpec,
        command: Command,
        cwd: str | None,
        env: Mapping[str, str] | None,
    ) -> RelayedProcess | None:
        """An agent command on a subtree node, through its inner node; None for another
        command, or when no inner node can take it (the caller starts it directly)."""
        if not agent_verb(command):
            return None  # only herd's agent verbs travel a relay link
        inner = self.inner_for(node)
        if inner is None:
            return None
        argv = [str(word) for word in command]
        # Each node's relay runs on the interpreter of its own command (nodes may name
        # different ones): what one fan-out's nodes share is their inner node, cwd and env.
        key = (inner, cwd, tuple(sorted((env or {}).items())))
        return await self._steps.start(key, node.name, node.host, argv)

    def _relay_line(self, node: NodeSpec, process: RelayedProcess, key: tuple, batch: str) -> str:
        """The shell line that runs the relay on ``node`` for a batch, detached once it has
        its command, dialling the launcher where ``node``'s ssh session came from; on the
        interpreter its command runs on."""
        _, cwd, env = key
        python = process.argv[0]
        variables = dict(env) | {
            PORT_VAR: str(self._steps.server.port),
            BATCH_VAR: batch,
            NODE_VAR: node.name,
            HOST_VAR: self.transport.relay_address,
            DETACH_VAR: "1",
        }
        return self.transport.shell_line(node, [python, "-m", RELAY_MODULE], cwd, variables)

    async def _start_fanout(self, batch: StepBatch, hosts: list[str]) -> asyncio.subprocess.Process:
        inner = self.transport.cluster.node(batch.key[0])
        nodes = []
        for name, process in batch.processes.items():
            node = self.transport.cluster.node(name)
            line = self._relay_line(node, process, batch.key, batch.batch)
            nodes.append({"name": name, "argv": self.transport.onward_argv(node, line)})
            self.routes[node.host] = inner.host
            self.direct.pop(node.host, None)
        python = self.transport.cluster.python_for(inner)
        fanout = await self.transport.start_flat(inner, [python, "-m", FANOUT_MODULE])
        assert fanout.stdin is not None
        request = json.dumps({"nodes": nodes})
        fanout.stdin.write(f"{self._steps.server.token}\n{request}\n".encode())
        try:
            await fanout.stdin.drain()
        except (ConnectionError, OSError):
            pass  # the session ended at once: its output says why
        fanout.stdin.close()
        return fanout

    async def _settle(self, batch: StepBatch) -> None:
        """Once the fan-out's session ends: a node whose relay never connected is reached
        directly where the inner node could not reach it (or could not run the fan-out at
        all); otherwise its command ended as the fan-out says (no python there, a failed
        setup: the node's own failure, passed on as flat ssh would)."""
        code = await batch.read_step()
        inner = batch.key[0]
        for name, process in batch.processes.items():
            self._steps.server.forget(batch.batch, name)
            if process.finished or process.attached:
                continue  # a connected relay's link says how its command ends
            result, err = batch.ended(name, code)
            text = err.decode(errors="replace")
            if code != 0:
                self.down.add(inner)
                why = f"{inner} could not start its subtree: {_last_line(text, code)}"
            elif result == SSH_ERROR or CANNOT_CONNECT in text:
                why = f"{inner} could not reach it: {_last_line(text, result)}"
            else:
                process.finish(result, err)
                continue
            node = self.transport.cluster.node(name)
            self.routes.pop(node.host, None)
            self.direct[node.host] = why
            self._spawn(self._start_directly(node, process, batch.key))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_directly(self, node: NodeSpec, process: RelayedProcess, key: tuple) -> None:
        """The relay on ``node`` over the launcher's own ssh: the same command, the same link."""
        failure = await self.transport.connect_direct(node)
        if failure is not None:
            process.finish(SSH_ERROR, f"{failure.detail}\n".encode())
            return
        self._count += 1
        batch = f"d{self._count}"
        self._steps.server.expect(batch, node.name, process)
        line = self._relay_line(node, process, key, batch)
        try:
            session = await self.transport.start_flat(node, line)
            out, err = await session.communicate(f"{self._steps.server.token}\n".encode())
        except OSError as exc:
            process.finish(SSH_ERROR, f"cannot run ssh: {exc}\n".encode())
            return
        finally:
            self._steps.server.forget(batch, node.name)
        if not process.finished and not process.attached:
            code = session.returncode
            process.finish(code if code else 1, err)

    def lines(self) -> list[str]:
        """What ``herd launch -v`` says about the tree: which node went through which."""
        if not self.routes and not self.direct:
            return []
        through: dict[str, list[str]] = {host: [] for host in self.inner}
        for host, inner in self.routes.items():
            through.setdefault(inner, []).append(host)
        reached = sum(len(hosts) for hosts in through.values())
        inner = f"{len(self.inner)} inner node{'s' if len(self.inner) > 1 else ''}"
        lines = [
            f"a tree of {inner}: ssh from here to {', '.join(self.inner)}; "
            f"{reached} nodes reached through {'them' if len(self.inner) > 1 else 'it'}"
        ]
        for inner, hosts in through.items():
            if hosts:
                lines.append(f"reached through {inner}: {', '.join(hosts)}")
        for host, why in self.direct.items():
            lines.append(f"reached directly: {host} ({why})")
        return lines

    async def close(self) -> None:
        """At the launcher's end: a fan-out whose relays have all ended gets a moment to end by
        itself (it does once its subtree's agents are gone), then its ssh is ended."""
        for task in list(self._tasks):
            task.cancel()
        await self._steps.close(grace=FANOUT_END_GRACE)


def classify_relay_failure(host: str, returncode: int, stderr: str) -> Unreachable | None:
    """An Unreachable when a node's relay link failed (it could not dial this launcher, or
    its link dropped); None otherwise (ssh's own failures are classified as ssh's)."""
    return relay_link_failure(
        host,
        returncode,
        stderr,
        cannot_connect=f"{host} cannot open a TCP connection back to this machine: allow "
        "connections from the nodes to it, or keep the tree off ([cluster] tree_above)",
        link_lost=f"check that {host} is up and reachable from this machine",
    )


def _last_line(text: str, code: int) -> str:
    """The last thing ssh (or the relay) said, without the fan-out's task labels."""
    lines = [
        _LABEL.sub("", line).strip()
        for line in text.splitlines()
        if line.strip() and "herd fanout: error:" not in line
    ]
    return lines[-1] if lines else f"exit code {code}"
