"""SimulatedHosts: a transport where every node is a host of its own on this machine.

A node's commands are local processes, started as a transport starts them on a node (the
node's setup prelude, its workdir, the allocation's and the command's variables), with no sshd
in between. What a node's link is, is kept: the launcher holds a Link per command, and
``kill()`` on it cuts the link as killing an ssh client does (the launcher's ends of the pipes
close, the command on the node sees its stdin close and its writes fail, and ends its job
there), instead of killing the command, which lives on the node, not in the launcher.

With ``tree`` (and more nodes than the cluster's ``tree_above``) the agents' commands go
through herd's own tree (transport/tree.py) as over ssh: the launcher starts the fan-out on a
few inner nodes, which start their subtree's relays (a shell on the node, where ssh would run
one), and every relay dials the launcher over TCP (this machine's loopback), so the launcher
holds a relay link a node, as it does over ssh and under Slurm at scale, not a process.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping

from torchherd.spec import ClusterSpec, NodeSpec
from torchherd.transport.base import Command, Transport, Unreachable, shell_for, wants_tree
from torchherd.transport.tree import NodeTree, classify_relay_failure

# The exit code a cut link reports, as ssh reports a lost connection.
LINK_CUT = 255


class Link(asyncio.subprocess.Process):
    """A node command as the launcher holds it: ``kill()`` cuts the link, never the command."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        super().__init__(process._transport, process._protocol, process._loop)  # type: ignore[attr-defined]
        self._cut = asyncio.Event()

    @property
    def returncode(self) -> int | None:  # type: ignore[override]
        if self._cut.is_set():
            return LINK_CUT
        return self._transport.get_returncode()  # type: ignore[attr-defined,no-any-return]

    @property
    def cut(self) -> bool:
        return self._cut.is_set()

    def kill(self) -> None:
        self.cut_link()

    def terminate(self) -> None:
        self.cut_link()

    def cut_link(self) -> None:
        """Close the launcher's ends of the command's pipes; the command learns it there."""
        if self._cut.is_set() or self._transport.get_returncode() is not None:  # type: ignore[attr-defined]
            return
        self._cut.set()
        for fd in (0, 1, 2):
            pipe = self._transport.get_pipe_transport(fd)  # type: ignore[attr-defined]
            if pipe is not None:
                pipe.close()

    async def wait(self) -> int:
        exited = asyncio.ensure_future(super().wait())
        cut = asyncio.ensure_future(self._cut.wait())
        try:
            await asyncio.wait({exited, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (exited, cut):
                if not task.done():
                    task.cancel()
        code = self.returncode
        assert code is not None
        return code


class SimulatedHosts(Transport):
    """Each node a separate host on this machine; its commands are local processes."""

    # A tree's relays dial the launcher on this machine.
    relay_address = "127.0.0.1"

    def __init__(self, cluster: ClusterSpec, *, tree: bool = False) -> None:
        super().__init__(cluster)
        self.tree: NodeTree | None = None
        if wants_tree(cluster, tree):
            self.tree = NodeTree(self)

    async def connect(self, node: NodeSpec) -> Unreachable | None:
        return None  # no link to open: a command is a local process

    async def connect_direct(self, node: NodeSpec) -> Unreachable | None:
        return None

    def connected(self, host: str) -> bool:
        return True  # a local process always starts

    def lost(self, host: str) -> None:
        if self.tree is not None:
            self.tree.down.add(host)  # as over ssh: no more subtrees through it

    def onward_argv(self, node: NodeSpec, line: str) -> list[str]:
        return ["/bin/sh", "-c", line]  # what an inner node's ssh would run on ``node``

    async def start(
        self,
        node: NodeSpec,
        command: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> asyncio.subprocess.Process:
        if self.tree is not None:
            relayed = await self.tree.start(node, command, cwd, env)
            if relayed is not None:
                return relayed
        return await self.start_flat(node, command, cwd=cwd, env=env)

    async def start_flat(
        self,
        node: NodeSpec,
        command: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> asyncio.subprocess.Process:
        """A command as a local process of the node, held by this launcher."""
        setup = self.cluster.setup_for(node)
        if isinstance(command, str) or setup:
            # What a node's shell would run: prelude, workdir, variables, command.
            argv = [shell_for(setup), "-c", self.shell_line(node, command, cwd, env)]
            process_env, process_cwd = None, None
        else:
            argv = list(command)
            extra = {**self.cluster.carry_env, **(env or {})}
            # Nothing to add: the process inherits this one's environment as it is (no copy
            # of it a node, which the launcher would pay at 1,000 nodes).
            process_env = {**os.environ, **extra} if extra else None
            process_cwd = os.path.expanduser(cwd) if cwd else None
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=process_cwd,
            env=process_env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=1 << 24,
            start_new_session=True,  # the node's, not the launcher's terminal
        )
        return Link(process)

    def classify_failure(self, node: NodeSpec, returncode: int, stderr: str) -> Unreachable | None:
        if self.tree is not None and not self.tree.is_inner(node):
            return classify_relay_failure(node.host, returncode, stderr)
        return None  # a local process always starts; only the launcher cuts a link

    def route_lines(self) -> list[str]:
        return self.tree.lines() if self.tree is not None else []
