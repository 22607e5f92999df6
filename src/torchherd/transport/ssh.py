"""SSH transport: the user's own OpenSSH client, driven by asyncio subprocesses.

Using the real client means ~/.ssh/config, ProxyJump, agents, Kerberos and known_hosts behave
exactly as they do for the user. One ControlMaster per node is opened by ``connect`` and reused
by every later command of this process, so a launch costs one handshake per node.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..agent.relay import SSH_CLIENT_ADDR
from ..agent.workers import process_state
from ..errors import ConfigError
from ..spec import ClusterSpec, NodeSpec
from .base import Command, Transport, Unreachable, wants_tree
from .host_keys import HostKeyPolicy

if TYPE_CHECKING:
    from .tree import NodeTree

# ssh's words for each way a connection fails, checked in this order; first match wins.
_FAILURES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "host-key-unknown",
        # "No ED25519 host key is known for gpu1 and you have requested strict checking."
        ("host key is known for",),
        "your ssh config asks for strict host key checking and {host}'s key is not in your "
        "known_hosts: connect once with `ssh {host} true` and check the fingerprint it shows",
    ),
    (
        "host-key-changed",
        ("REMOTE HOST IDENTIFICATION HAS CHANGED", "Host key verification failed"),
        "if {host} was reinstalled, drop its old key with `ssh-keygen -R {host}` and retry; "
        "otherwise find out why its key changed before trusting it",
    ),
    (
        "unknown-name",
        ("Could not resolve hostname", "Name or service not known", "nodename nor servname"),
        "check the spelling of {host}, or add a `Host {host}` entry with its HostName "
        "to your ssh config",
    ),
    (
        "auth",
        ("Permission denied", "Too many authentication failures", "no matching host key type"),
        "install your key with `herd ssh-setup`, or set User/IdentityFile for {host} "
        "in your ssh config",
    ),
    (
        "refused",
        ("Connection refused",),
        "nothing listens for ssh on {host}: start sshd there, or set its Port in your ssh config",
    ),
    (
        "timeout",
        ("timed out", "Connection timed out", "Operation timed out"),
        "{host} did not answer within {timeout:g} s: check it is up, on this network (VPN?), "
        "and that no firewall drops port 22",
    ),
    (
        "no-route",
        ("No route to host", "Network is unreachable", "Host is down"),
        "{host} is not reachable from this machine: check the network path (VPN, subnet, "
        "ProxyJump in your ssh config)",
    ),
)

# ssh exits with 255 for its own errors; anything else is the remote command's exit code.
SSH_ERROR = 255


def classify_ssh_failure(
    host: str, returncode: int, stderr: str, timeout: float
) -> Unreachable | None:
    """Turn ssh's exit code and error output into an Unreachable, or None if ssh itself worked."""
    if returncode != SSH_ERROR:
        return None
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    meaningful = [line for line in lines if not line.startswith(("Warning:", "@@@"))]
    detail = (meaningful or lines or ["no output from ssh"])[-1]
    for reason, patterns, remedy in _FAILURES:
        if any(pattern in stderr for pattern in patterns):
            return Unreachable(host, reason, detail, remedy.format(host=host, timeout=timeout))
    return Unreachable(
        host, "ssh-error", detail, f"run `ssh -v {host} true` to see where ssh fails"
    )


def _alive(pid: int) -> bool:
    """Whether the pid still runs. An exited master is a zombie until the process that
    adopted it reaps it: at once under a plain init, seconds later under some container
    inits, never under an entrypoint that reaps nothing; it is gone either way."""
    return process_state(pid) not in ("?", "Z", "X")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


CONTROL_PREFIX = "herd-ssh-"


def _remove_orphaned_control_dirs() -> None:
    """Remove the empty control directories of this user's launchers that are gone (their
    masters end ControlPersist seconds after them and take their sockets along; a directory
    still holding one is left for the next launcher)."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(CONTROL_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(CONTROL_PREFIX) :].split("-", 1)[0]
        path = os.path.join(root, name)
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            if os.stat(path).st_uid == os.getuid():
                os.rmdir(path)
        except OSError:
            continue  # not empty, or not ours


# ssh options that belong to the launcher's own connections, not to an inner node's.
_LAUNCHER_ONLY = ("ControlPath=", "ControlMaster=", "ControlPersist=")


class SshTransport(Transport):
    # A tree's relays dial the launcher where their inner node's ssh session came from.
    relay_address = SSH_CLIENT_ADDR

    def __init__(self, cluster: ClusterSpec, fanout: int = 64, *, tree: bool = False) -> None:
        """``tree``: above ``cluster.tree_above`` nodes, start herd's agents through a tree of
        inner nodes (transport/tree.py) instead of a connection per node."""
        super().__init__(cluster, fanout)
        if cluster.ssh_config and not os.path.isfile(os.path.expanduser(cluster.ssh_config)):
            raise ConfigError(
                f"ssh_config {cluster.ssh_config} (from {cluster.source}) does not exist",
                "fix the path in [cluster] ssh_config, or remove it to use ~/.ssh/config",
            )
        self._ssh = shutil.which("ssh")
        if self._ssh is None:
            raise ConfigError(
                "the OpenSSH client `ssh` is not installed on this machine",
                "install it (Debian/Ubuntu: apt-get install openssh-client)",
            )
        # A private directory per launcher process: masters are never shared with, or taken
        # over by, another user or another herd run. The path stays short (sockets max ~100 B).
        # Its name carries this launcher's pid: a launcher that was SIGKILLed (a laptop that
        # died) cannot remove its directory, and the next one removes it for it.
        _remove_orphaned_control_dirs()
        self._control_dir = tempfile.mkdtemp(prefix=f"{CONTROL_PREFIX}{os.getpid()}-")
        os.chmod(self._control_dir, 0o700)
        self._masters: set[str] = set()
        config = ["-F", os.path.expanduser(cluster.ssh_config)] if cluster.ssh_config else []
        self._host_keys = HostKeyPolicy([self._ssh, *config])
        self.tree: NodeTree | None = None
        if wants_tree(cluster, tree):
            from .tree import NodeTree

            self.tree = NodeTree(self)

    def base_argv(self, node: NodeSpec, *, master: bool = False) -> list[str]:
        assert self._ssh is not None
        argv = [self._ssh]
        if self.cluster.ssh_config:
            argv += ["-F", os.path.expanduser(self.cluster.ssh_config)]
        timeout = max(1, round(self.cluster.connect_timeout))
        options = {
            "BatchMode": "yes",
            "ConnectTimeout": str(timeout),
            "ServerAliveInterval": "5",
            "ServerAliveCountMax": "3",
            # accept-new only where the user's own setting is ssh's default (see host_keys).
            **self._host_keys.option(node.host),
            "ForwardAgent": "no",
            "ForwardX11": "no",
            "ControlPath": os.path.join(self._control_dir, "%C"),
            "ControlMaster": "yes" if master else "no",
        }
        if master:
            # Kept while sessions use it; gone 30 s after the last one if herd itself dies.
            options["ControlPersist"] = "30"
        for key, value in options.items():
            argv += ["-o", f"{key}={value}"]
        return argv

    def onward_argv(self, node: NodeSpec, line: str) -> list[str]:
        """The ssh an inner node of a tree runs to run ``line`` on ``node``: the launcher's
        options for it, less its private connection sharing, with the inner node's own
        ``ssh``."""
        out = ["ssh"]
        words = iter(self.base_argv(node)[1:])
        for word in words:
            if word == "-o":
                option = next(words)
                if not option.startswith(_LAUNCHER_ONLY):
                    out += ["-o", option]
            else:
                out.append(word)
        return [*out, "-T", node.host, "--", line]

    def connected(self, host: str) -> bool:
        """Whether this node's master connection was opened."""
        return host in self._masters

    def lost(self, host: str) -> None:
        """Its master may still look open (ssh's keep-alives take 15 s to give up on a cut
        link): it is opened again on next use, and in a tree the node carries no subtree's
        commands until then (they go through the other inner nodes at once)."""
        self._masters.discard(host)
        if self.tree is not None:
            self.tree.down.add(host)

    async def connect(self, node: NodeSpec) -> Unreachable | None:
        """A node's link: its master connection (connect_direct), or, in a tree, nothing yet
        for a node below an inner node (its first agent command says whether it is up)."""
        if self.tree is not None and not self.tree.is_inner(node):
            return None
        return await self.connect_direct(node)

    async def connect_direct(self, node: NodeSpec) -> Unreachable | None:
        """Open this node's master connection: a real login, so failures say why.

        The first try passes no StrictHostKeyChecking (a known key connects the same under
        every setting); only a node refused for its host key makes herd learn the user's
        setting, and try again with ``accept-new`` where that setting is ssh's default."""
        if node.host in self._masters:
            return None
        failure = await self._open_master(node)
        if (
            failure is not None
            and failure.reason in ("host-key-unknown", "host-key-changed")
            and not self._host_keys.learned(node.host)
        ):
            await self._host_keys.learn(node.host)
            if self._host_keys.option(node.host):
                failure = await self._open_master(node)
        if failure is None:
            self._masters.add(node.host)
            if self.tree is not None:
                self.tree.down.discard(node.host)  # back: it may carry its subtree again
        return failure

    async def _open_master(self, node: NodeSpec) -> Unreachable | None:
        argv = self.base_argv(node, master=True) + ["-N", "-f", "-T", node.host]
        # -f backgrounds the master after authentication; its stdio must not be our pipes,
        # or a reader would wait for the master to exit. Errors come back through a file.
        with tempfile.TemporaryFile() as errors:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=errors,
                # Its own process group: the master it forks stays findable (and the terminal's
                # Ctrl-C goes to herd, which decides what to stop).
                start_new_session=True,
            )
            try:
                code = await asyncio.wait_for(process.wait(), self.cluster.connect_timeout + 5)
            except asyncio.CancelledError:
                # Ctrl-C while connecting: neither the client nor a master it forked may
                # outlive herd.
                _kill_group(process.pid)
                raise
            except TimeoutError:
                _kill_group(process.pid)
                await process.wait()
                return Unreachable(
                    node.host,
                    "timeout",
                    f"no answer within {self.cluster.connect_timeout:g} s",
                    f"check that {node.host} is up and reachable from this machine",
                )
            errors.seek(0)
            stderr = errors.read().decode(errors="replace")
        if code != 0:
            return classify_ssh_failure(node.host, SSH_ERROR, stderr, self.cluster.connect_timeout)
        return None

    async def start(
        self,
        node: NodeSpec,
        command: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> asyncio.subprocess.Process:
        if self.tree is not None and not self.tree.is_inner(node):
            process = await self.tree.start(node, command, cwd, env)
            if process is not None:
                return process
            # Directly: over a master opened on first use (a failure there, ssh says again).
            await self.connect_direct(node)
        return await self.start_flat(node, command, cwd=cwd, env=env)

    async def start_flat(
        self,
        node: NodeSpec,
        command: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> asyncio.subprocess.Process:
        """A command over this launcher's own ssh session to the node."""
        remote = self.shell_line(node, command, cwd, env)
        argv = self.base_argv(node) + ["-T", node.host, "--", remote]
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=1 << 24,
            # A session of its own: the terminal's Ctrl-C (sent to the whole foreground process
            # group) reaches herd only, which stops the job through the agents; an ssh client
            # killed by it would cut its node off, and the node would be reported "lost".
            start_new_session=True,
        )

    def classify_failure(self, node: NodeSpec, returncode: int, stderr: str) -> Unreachable | None:
        if self.tree is not None and not self.tree.is_inner(node):
            from .tree import classify_relay_failure

            found = classify_relay_failure(node.host, returncode, stderr)
            if found is not None:
                return found
        return classify_ssh_failure(node.host, returncode, stderr, self.cluster.connect_timeout)

    def master_pids(self) -> list[int]:
        """This transport's masters: the processes of this user whose command line names its
        private control directory (no `ssh -O check` per node: one look at /proc for all; the
        control socket cannot say, its listener's pid is the ssh that forked the master)."""
        marker = f"ControlPath={self._control_dir}/".encode()
        uid = os.getuid()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if marker not in handle.read():
                        continue
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                continue  # gone meanwhile
        return found

    def route_lines(self) -> list[str]:
        return self.tree.lines() if self.tree is not None else []

    async def close(self) -> None:
        """End every master (SIGTERM: it closes its connection and its socket), wait until
        they are gone (SIGKILL after 2 s), then remove the private control directory, so
        nothing herd started outlives herd."""
        if self.tree is not None:
            await self.tree.close()  # its fan-outs and its relay server's socket
        masters = self.master_pids() if self._masters else []
        for pid in masters:
            _signal(pid, signal.SIGTERM)
        for _ in range(40):
            masters = [pid for pid in masters if _alive(pid)]
            if not masters:
                break
            await asyncio.sleep(0.05)
        for pid in masters:
            _signal(pid, signal.SIGKILL)
        self._masters.clear()
        shutil.rmtree(self._control_dir, ignore_errors=True)
