"""The Transport interface and the result types every transport returns."""

from __future__ import annotations

import asyncio
import resource
import shlex
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..spec import ClusterSpec, NodeSpec

T = TypeVar("T")

# How many nodes are contacted at once. Hundreds of nodes are reached in waves of this size,
# which keeps the launcher under typical file-descriptor and sshd MaxStartups limits.
DEFAULT_FANOUT = 64
# File descriptors the launcher may hold per node during a job: a link's pipes (stdin, stdout,
# stderr) or socket, and the job's log files (one per rank), with room to spare.
FDS_PER_NODE = 16
FDS_BESIDES = 256


def raise_fd_limit(nodes: int) -> int:
    """Raise this process's soft limit on open files to what ``nodes`` nodes need, up to the
    hard limit (the default soft limit, often 1024, ends a launch of a few hundred nodes with
    "Too many open files"); never lowers it. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FDS_BESIDES + FDS_PER_NODE * nodes
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass  # not allowed here: the launch goes on within the limit it has
    return soft


@dataclass(frozen=True)
class Unreachable:
    """Why a node could not be reached, classified from ssh's own words."""

    host: str
    reason: str
    """One of: timeout, refused, auth, host-key-changed, host-key-unknown, unknown-name,
    no-route, ssh-error."""
    detail: str
    """ssh's last line of error output."""
    remedy: str

    def describe(self) -> str:
        return f"{self.host}: {_REASON_TEXT.get(self.reason, self.reason)} ({self.detail})"


_REASON_TEXT = {
    "timeout": "connection timed out",
    "refused": "connection refused",
    "auth": "authentication failed",
    "host-key-changed": "host key changed",
    "host-key-unknown": "host key not known",
    "unknown-name": "unknown host name",
    "no-route": "no route to host",
    "ssh-error": "ssh failed",
}


@dataclass(frozen=True)
class CommandResult:
    """The outcome of one command on one node."""

    host: str
    returncode: int
    stdout: str
    stderr: str
    duration: float
    unreachable: Unreachable | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.unreachable is None and not self.timed_out


Command = str | Sequence[str]
"""A shell command line (run by the node's shell, so pipes work) or an argv (quoted for you)."""


def agent_verb(command: Command) -> bool:
    """Whether a command is one of herd's agent verbs (``python -m torchherd.agent ...``),
    which a relay link can carry (transport/relay.py)."""
    return not isinstance(command, str) and list(command[1:3]) == ["-m", "torchherd.agent"]


def wants_tree(cluster: ClusterSpec, tree: bool) -> bool:
    """Whether a transport asked for a tree (a launch's) starts the agents through one: more
    nodes than ``[cluster] tree_above`` (transport/tree.py)."""
    return tree and cluster.tree_above is not None and len(cluster.nodes) > cluster.tree_above


def as_shell(command: Command) -> str:
    """An argv as one shell line; its program may start with ``~/`` (expanded on the node)."""
    if isinstance(command, str):
        return command
    if not command:
        return ""
    return " ".join([home_quote(command[0]), *(shlex.quote(word) for word in command[1:])])


def home_quote(path: str) -> str:
    """Quote a path for the node's shell, letting a leading ``~`` mean the node's home there
    (shlex.quote alone would make it a literal ``~`` directory that never exists)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return f'"$HOME"/{shlex.quote(path[2:])}'
    return shlex.quote(path)


def cd_prefix(cwd: str | None) -> str:
    """Shell text that enters cwd, expanding a leading ~ on the node (not here)."""
    if not cwd:
        return ""
    return f"cd {home_quote(cwd)} && "


# Exit code of a node command whose setup prelude failed (and the word that says so on stderr).
SETUP_FAILED_EXIT = 97
SETUP_FAILED_MARK = "herd: setup failed"


def setup_prelude(setup: str | None) -> str:
    """Shell text that runs the setup commands in the current shell (so `module load` and
    `source venv/bin/activate` hold for the command after it), with their output on stderr
    (stdout is the agent's channel); on failure it says so and exits SETUP_FAILED_EXIT."""
    if not setup or not setup.strip():
        return ""
    return (
        f"{{ {setup.strip()}\n}} >&2 || "
        f'{{ echo "{SETUP_FAILED_MARK} with exit code $?" >&2; exit {SETUP_FAILED_EXIT}; }}; '
    )


def remote_line(
    command: Command,
    cwd: str | None,
    env: Mapping[str, str] | None,
    setup: str | None = None,
) -> str:
    """One shell line for a node: run the setup prelude, enter cwd, set env, run the command."""
    line = as_shell(command)
    if env:
        assignments = " ".join(shlex.quote(f"{key}={value}") for key, value in env.items())
        # A shell line given as text must keep its pipes and redirections: run it in a shell.
        body = f"sh -c {shlex.quote(command)}" if isinstance(command, str) else line
        line = f"env {assignments} {body}"
    return setup_prelude(setup) + cd_prefix(cwd) + line


def shell_for(setup: str | None) -> str:
    """The shell that runs a line with this prelude: bash for `module` and `source`, else sh."""
    return "bash" if setup else "/bin/sh"


def setup_failure(returncode: int, stderr: str) -> str | None:
    """The output of a failed setup prelude, when that is why a node command failed."""
    if returncode != SETUP_FAILED_EXIT or SETUP_FAILED_MARK not in stderr:
        return None
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return "\n".join(lines[-15:])


class Transport(ABC):
    """Starts commands on the nodes of one cluster."""

    def __init__(self, cluster: ClusterSpec, fanout: int = DEFAULT_FANOUT) -> None:
        raise_fd_limit(len(cluster.nodes))
        self.cluster = cluster
        self._fanout = asyncio.Semaphore(fanout) if fanout else None
        self.fanout_limit = fanout

    @abstractmethod
    async def connect(self, node: NodeSpec) -> Unreachable | None:
        """Open (and keep) the link to a node; None when it is up, else why it is not."""

    @abstractmethod
    async def start(
        self,
        node: NodeSpec,
        command: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> asyncio.subprocess.Process:
        """Start a command with piped stdin/stdout/stderr. ``env`` must hold no secrets:
        on ssh it becomes part of the remote command line; send secrets over stdin instead."""

    def shell_line(
        self,
        node: NodeSpec,
        command: Command,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """The shell line that runs ``command`` on ``node``: the node's setup prelude, cwd, the
        variables an allocation carries (``carry_env``) and ``env``."""
        merged = {**self.cluster.carry_env, **(env or {})}
        return remote_line(command, cwd, merged, setup=self.cluster.setup_for(node))

    @abstractmethod
    def classify_failure(self, node: NodeSpec, returncode: int, stderr: str) -> Unreachable | None:
        """Whether a failed command failed because the node could not be reached."""

    async def close(self) -> None:  # noqa: B027 - optional hook; most transports keep nothing
        """Drop kept links."""

    def lost(self, host: str) -> None:  # noqa: B027 - optional hook; most transports keep nothing
        """The launcher judged ``host`` lost and it did not answer a sweep: links kept to it
        are not to be trusted (a cut link closes nothing) until it is connected again."""

    def route_lines(self) -> list[str]:
        """How the nodes were reached, where that is not simply one link each (a tree)."""
        return []

    async def run(
        self,
        node: NodeSpec,
        command: Command,
        *,
        input: bytes | None = None,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run a command to completion and collect its output."""
        started = time.monotonic()
        process = await self.start(node, command, cwd=cwd, env=env)
        try:
            # Always feed stdin (even empty) so it closes: a node command never waits on it.
            out, err = await asyncio.wait_for(process.communicate(input or b""), timeout)
        except asyncio.CancelledError:
            # Interrupted: the command (and its ssh client) must not outlive herd.
            if process.returncode is None:
                try:
                    process.kill()
                except ProcessLookupError:
                    pass
            raise
        except TimeoutError:
            await _kill(process)
            return CommandResult(node.host, -1, "", "", time.monotonic() - started, timed_out=True)
        stderr = err.decode(errors="replace")
        code = process.returncode if process.returncode is not None else -1
        return CommandResult(
            host=node.host,
            returncode=code,
            stdout=out.decode(errors="replace"),
            stderr=stderr,
            duration=time.monotonic() - started,
            unreachable=self.classify_failure(node, code, stderr) if code != 0 else None,
        )

    async def each(
        self,
        nodes: Iterable[NodeSpec],
        action: Callable[[NodeSpec], Awaitable[T]],
        on_done: Callable[[NodeSpec, T], None] | None = None,
    ) -> list[T]:
        """Run ``action`` for every node in parallel (bounded by the fan-out), in node order."""

        async def bounded(node: NodeSpec) -> T:
            if self._fanout is None:
                result = await action(node)
            else:
                async with self._fanout:
                    result = await action(node)
            if on_done is not None:
                on_done(node, result)
            return result

        return list(await asyncio.gather(*(bounded(node) for node in nodes)))


async def local_output(
    argv: Sequence[str], timeout: float, *, stderr: bool = False
) -> bytes | None:
    """Run a short local command (``ssh -G``, ``ssh -O``) without blocking the event loop; its
    stdout (or stderr), or None when it did not finish in ``timeout`` s or failed."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL if stderr else asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE if stderr else asyncio.subprocess.DEVNULL,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        await _kill(process)
        return None
    if process.returncode != 0 and not stderr:
        return None
    return err if stderr else out


async def _kill(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        try:
            process.kill()
        except ProcessLookupError:
            pass
    try:
        await asyncio.wait_for(process.wait(), 5)
    except TimeoutError:
        pass
