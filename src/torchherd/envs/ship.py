"""Making every node's environment equal to one target, over herd's own transport.

Per node: look (what it has: platform, free space, cached wheels, environments), then, for
nodes that differ, send only the wheels (and uv binary) its cache lacks as one tar stream, then
have it build and switch (``agent/envnode.py``). Wheels are resolved once per platform on the
launcher. Nothing is written anywhere until every node that needs work has the space for it.

Above ``relay_above`` nodes to sync, the nodes that lack the same files form a chain: the
launcher streams one copy to the first, and each node passes every byte on to the next as it
arrives (a TCP connection opened by the node after it, checked with a one-time token), so the
launcher sends one copy, not one per node. A node the chain did not reach is sent its files
directly afterwards.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..agent import envid, envnode
from ..spec import ClusterSpec, NodeSpec
from ..transport import Transport, for_cluster
from .identity import EnvTarget, differences
from .resolve import Platform, resolve
from .uvbin import uv_binary, uv_version

DEFAULT_ROOT = "~/.herd/envs"
SPACE_MARGIN = 16 << 20
"""Free bytes kept beyond what a sync is computed to need (metadata, uv's own files)."""
NO_PYTHON_EXIT = 127
RELAY_ABOVE = 16
"""Nodes to sync above which nodes that lack the same files pass them on to each other."""


@dataclass
class NodeResult:
    """One node's part in a sync (or a status)."""

    host: str
    state: str = "unknown"
    """``same``, ``synced``, ``failed``, ``refused``, ``differs``."""
    before: str | None = None
    after: str | None = None
    bytes_sent: int = 0
    files_sent: int = 0
    platform: str = ""
    detail: str = ""
    changes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class NodeFailed(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


Progress = Callable[[str, str], None]
"""(host, what is happening now)"""


def _program() -> bytes:
    """The first line of every node action's stdin: the node-side modules, as source."""
    sources = {
        "envid": Path(envid.__file__).read_text(),
        "envnode": Path(envnode.__file__).read_text(),
    }
    return (json.dumps(sources) + "\n").encode()


class EnvSync:
    """One ``herd env`` run against a cluster: look, then sync, status, use or remove."""

    def __init__(
        self,
        cluster: ClusterSpec,
        *,
        root: str = DEFAULT_ROOT,
        node_python: str = "python3",
        transport: Transport | None = None,
        progress: Progress | None = None,
        relay_above: int = RELAY_ABOVE,
    ) -> None:
        self.relay_above = relay_above
        self.cluster = cluster
        self.root = root
        self.node_python = node_python
        self.transport = transport or for_cluster(cluster)
        self.progress = progress or (lambda host, what: None)
        self._program = _program()

    def _argv(self, action: str, **args: Any) -> list[str]:
        return [
            self.node_python,
            "-c",
            envnode.BOOTSTRAP,
            action,
            json.dumps({"root": self.root, **args}),
        ]

    async def _action(
        self,
        node: NodeSpec,
        action: str,
        body: bytes = b"",
        timeout: float | None = None,
        **args: Any,
    ) -> dict[str, Any]:
        result = await self.transport.run(
            node, self._argv(action, **args), input=self._program + body, timeout=timeout
        )
        return self._answer(
            node,
            result.returncode,
            result.stdout,
            result.stderr,
            result.unreachable.describe() if result.unreachable else None,
            result.timed_out,
        )

    def _answer(
        self,
        node: NodeSpec,
        code: int,
        stdout: str,
        stderr: str,
        unreachable: str | None,
        timed_out: bool = False,
    ) -> dict[str, Any]:
        if unreachable:
            raise NodeFailed(f"unreachable: {unreachable}")
        if timed_out:
            raise NodeFailed("no answer in time")
        events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        for event in events:
            if "done" in event:
                return dict(event["done"])
            if "error" in event:
                if event.get("errno") == 28:
                    raise NodeFailed(f"disk full: {event['error']}")
                raise NodeFailed(str(event["error"]))
        if code == NO_PYTHON_EXIT or "not found" in stderr and self.node_python in stderr:
            raise NodeFailed(
                f"no {self.node_python} on this node: install Python 3 there (e.g. `apt install "
                f"python3`), or name its interpreter with --node-python PATH"
            )
        tail = stderr.strip().splitlines()[-1:] or [f"exit code {code}"]
        raise NodeFailed(f"the node side failed: {tail[0]}")

    # ---- look ----------------------------------------------------------------------------

    async def look(self, node: NodeSpec) -> dict[str, Any] | NodeFailed:
        timeout = self.cluster.connect_timeout + 60
        try:
            return await self._action(node, "look", timeout=timeout)
        except NodeFailed as exc:
            return exc

    async def look_all(self) -> dict[str, dict[str, Any] | NodeFailed]:
        seen = await self.transport.each(self.cluster.nodes, self.look)
        return {node.host: result for node, result in zip(self.cluster.nodes, seen, strict=True)}

    # ---- sync ----------------------------------------------------------------------------

    async def sync(self, target: EnvTarget, folders: list[Path]) -> list[NodeResult]:
        try:
            return await self.run_sync(target, folders)
        finally:
            await self.transport.close()

    async def run_sync(self, target: EnvTarget, folders: list[Path]) -> list[NodeResult]:
        """``sync`` on a transport its caller keeps open (a launch syncing before it starts)."""
        want = target.hash
        seen = await self.look_all()
        results = {node.host: NodeResult(node.host) for node in self.cluster.nodes}
        work: dict[str, tuple[dict[str, Any], dict[str, Path]]] = {}
        by_platform: dict[Platform, dict[str, Path]] = {}
        for node in self.cluster.nodes:
            result, facts = results[node.host], seen[node.host]
            if isinstance(facts, NodeFailed):
                result.state, result.detail = "failed", facts.message
                continue
            platform = Platform(facts["machine"], facts.get("glibc"), facts["python_tag"])
            result.platform = platform.describe()
            node_minor = ".".join(str(facts["python_version"]).split(".")[:2])
            want_minor = ".".join(target.python_version.split(".")[:2])
            if node_minor != want_minor:
                result.state = "failed"
                result.detail = (
                    f"{self.node_python} here is Python {facts['python_version']}, the "
                    f"environment is for {want_minor}: install Python {want_minor} there and "
                    f"name it with --node-python, or lock for {node_minor}"
                )
                continue
            result.before = facts.get("current")
            envs = facts.get("envs", {})
            current = envs.get(result.before or "", {})
            if result.before == want and current.get("hash") == want:
                result.state, result.after = "same", want
                continue
            if platform not in by_platform:
                by_platform[platform] = resolve(target, platform, folders)
            work[node.host] = (facts, by_platform[platform])
        uv = Path(uv_binary())
        refused = self._check_space(work, results, uv)
        if refused:
            for host in work:
                if results[host].state != "refused":
                    results[host].state = "refused"
                    results[host].detail = "not started: other nodes lack disk space"
            return list(results.values())
        nodes = [node for node in self.cluster.nodes if node.host in work]
        relayed: set[str] = set()
        if len(nodes) > self.relay_above:
            chains = self._chains(nodes, work, uv)
            done = await asyncio.gather(*(self._relay(chain, files) for chain, files in chains))
            for sent in done:
                for host, count in sent.items():
                    relayed.add(host)
                    results[host].bytes_sent, results[host].files_sent = count

        async def one(node: NodeSpec) -> None:
            facts, wheels = work[node.host]
            result = results[node.host]
            relay = node.host in relayed
            await self._sync_node(node, target, facts, wheels, uv, result, relayed=relay)

        await self.transport.each(nodes, one)
        return list(results.values())

    def _needs(self, facts: dict[str, Any], wheels: dict[str, Path], uv: Path) -> list[Path]:
        have = facts.get("cache", {})
        send = [path for path in wheels.values() if have.get(path.name) != path.stat().st_size]
        if uv_version() not in facts.get("uv", []):
            send.append(uv)
        return send

    def _check_space(
        self,
        work: dict[str, tuple[dict[str, Any], dict[str, Path]]],
        results: dict[str, NodeResult],
        uv: Path,
    ) -> bool:
        refused = False
        for host, (facts, wheels) in work.items():
            send = self._needs(facts, wheels, uv)
            unpacked = sum(_unpacked_size(path) for path in wheels.values())
            need = sum(path.stat().st_size for path in send) + unpacked + SPACE_MARGIN
            free = int(facts.get("free_bytes", 0))
            if free < need:
                refused = True
                result = results[host]
                result.state = "refused"
                result.detail = (
                    f"disk space: needs {_mib(need)} under {facts.get('root')}, "
                    f"{_mib(free)} free; nothing was written (free space there, or choose "
                    "another node-local folder with --root)"
                )
        return refused

    async def _sync_node(
        self,
        node: NodeSpec,
        target: EnvTarget,
        facts: dict[str, Any],
        wheels: dict[str, Path],
        uv: Path,
        result: NodeResult,
        *,
        relayed: bool = False,
    ) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        want = target.hash
        current = facts.get("envs", {}).get(result.before or "", {})
        result.changes = differences(target.packages, current.get("packages", {}))
        try:
            # One login for the send and the build (a launch has its masters open already;
            # a re-sync with nothing to do never gets here: its look was its one session).
            unreachable = await self.transport.connect(node)
            if unreachable is not None:
                raise NodeFailed(f"unreachable: {unreachable.describe()}")
            send = [] if relayed else self._needs(facts, wheels, uv)
            if send:
                self.progress(node.host, f"sending {len(send)} files")
                result.bytes_sent, result.files_sent = await self._send(node, send)
            self.progress(node.host, "building")
            names = sorted(path.name for path in wheels.values())
            done = await self._build(node, want, names)
            result.after = str(done["current"])
            result.state = "synced"
        except NodeFailed as exc:
            result.state = "failed"
            keep = result.before or "none"
            result.detail = f"{exc.message}; its previous environment ({keep}) is still current"
        result.seconds = loop.time() - started

    def _chains(
        self,
        nodes: list[NodeSpec],
        work: dict[str, tuple[dict[str, Any], dict[str, Path]]],
        uv: Path,
    ) -> list[tuple[list[NodeSpec], list[Path]]]:
        """Nodes that lack the same files, in cluster order: one chain each (two or more)."""
        groups: dict[tuple[str, ...], tuple[list[NodeSpec], list[Path]]] = {}
        for node in nodes:
            facts, wheels = work[node.host]
            send = self._needs(facts, wheels, uv)
            if send:
                key = tuple(sorted(str(path) for path in send))
                groups.setdefault(key, ([], send))[0].append(node)
        return [(chain, files) for chain, files in groups.values() if len(chain) > 1]

    async def _relay(self, chain: list[NodeSpec], files: list[Path]) -> dict[str, tuple[int, int]]:
        """Stream ``files`` once to ``chain[0]``, each node passing them on to the next; the
        nodes that received them whole, with the bytes the launcher sent each (the first node
        all, the others none). A node that fails is left out: it is sent its files directly."""
        token = secrets.token_hex(16)
        relay = {"relay": {"listen": False}}
        listen = {"relay": {"listen": True}}
        procs = [
            await self.transport.start(node, self._argv("receive", **(listen if i else relay)))
            for i, node in enumerate(chain)
        ]
        received: dict[str, tuple[int, int]] = {}
        try:
            for process in procs[1:]:
                assert process.stdin is not None
                process.stdin.write(self._program)
                await process.stdin.drain()
            said = await asyncio.gather(
                *(
                    asyncio.wait_for(_first_line(process), envnode.RELAY_WAIT)
                    for process in procs[1:]
                )
            )
            if any("listening" not in one for one in said):
                return {}  # a node cannot take part: every node is sent its files directly
            places = [
                {"addr": one.get("addr") or node.addr or node.name, "port": one["listening"]}
                for node, one in zip(chain[1:], said, strict=True)
            ]
            for i, process in enumerate(procs):
                assert process.stdin is not None
                told: dict[str, Any] = {"token": token}
                if i < len(places):
                    told["forward"] = {**places[i], "token": token}
                if i == 0:
                    process.stdin.write(self._program)
                process.stdin.write((json.dumps(told) + "\n").encode())
                await process.stdin.drain()
            head = procs[0]
            assert head.stdin is not None
            self.progress(
                chain[0].host, f"sending {len(files)} files (relayed to {len(chain) - 1})"
            )
            sent = await self._write_tar(head.stdin, files)
            for node, process in zip(chain, procs, strict=True):
                if process.stdin is not None and not process.stdin.is_closing():
                    process.stdin.close()
                out, err = await process.communicate()
                code = process.returncode if process.returncode is not None else -1
                try:
                    self._answer(node, code, out.decode(), err.decode(), None)
                except NodeFailed:
                    continue
                received[node.host] = (sent if node is chain[0] else 0, len(files))
        except (OSError, ValueError, TimeoutError):
            return received
        finally:
            for process in procs:
                _kill(process)
        return received

    async def _write_tar(self, stdin: asyncio.StreamWriter, files: list[Path]) -> int:
        """Write a tar of ``files`` (the uv binary under its versioned name); bytes written.
        A node side that ends early is no error here: its answer says why."""
        sent = 0
        try:
            for path in files:
                info = tarfile.TarInfo(
                    f"uv-{uv_version()}" if path == Path(uv_binary()) else path.name
                )
                info.size = path.stat().st_size
                info.mode = 0o644
                header = info.tobuf(format=tarfile.PAX_FORMAT)
                stdin.write(header)
                sent += len(header)
                with path.open("rb") as source:
                    while chunk := source.read(1 << 20):
                        stdin.write(chunk)
                        sent += len(chunk)
                        await stdin.drain()
                pad = -info.size % tarfile.BLOCKSIZE
                stdin.write(b"\0" * pad)
                sent += pad
            stdin.write(b"\0" * (2 * tarfile.BLOCKSIZE))
            await stdin.drain()
            stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass
        return sent

    async def _send(self, node: NodeSpec, files: list[Path]) -> tuple[int, int]:
        """Stream a tar of ``files`` to the node's ``receive``; the bytes written to it."""
        process = await self.transport.start(node, self._argv("receive"))
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(self._program)
            sent = await self._write_tar(process.stdin, files)
        except asyncio.CancelledError:
            _kill(process)
            raise
        out, err = await process.communicate()
        code = process.returncode if process.returncode is not None else -1
        unreachable = self.transport.classify_failure(node, code, err.decode()) if code else None
        self._answer(
            node, code, out.decode(), err.decode(), unreachable.describe() if unreachable else None
        )
        return sent, len(files)

    async def _build(self, node: NodeSpec, want: str, wheels: list[str]) -> dict[str, Any]:
        """Run the node's build, holding its stdin open: closing it (Ctrl-C here, a lost
        link) stops the build there, before anything is switched."""
        process = await self.transport.start(
            node, self._argv("build", hash=want, wheels=wheels, uv=uv_version())
        )
        assert process.stdin is not None and process.stdout is not None
        lines: list[str] = []
        try:
            process.stdin.write(self._program)
            await process.stdin.drain()
            while line := await process.stdout.readline():
                text = line.decode(errors="replace")
                lines.append(text)
                if text.startswith("{") and '"step"' in text:
                    self.progress(node.host, json.loads(text)["step"])
            err = await process.stderr.read() if process.stderr else b""
            await process.wait()
        except asyncio.CancelledError:
            _kill(process)
            raise
        finally:
            if not process.stdin.is_closing():
                process.stdin.close()
        code = process.returncode if process.returncode is not None else -1
        unreachable = self.transport.classify_failure(node, code, err.decode()) if code else None
        return self._answer(
            node,
            code,
            "".join(lines),
            err.decode(),
            unreachable.describe() if unreachable else None,
        )

    # ---- status, use, rm ---------------------------------------------------------------

    async def status(self, target: EnvTarget) -> list[NodeResult]:
        try:
            seen = await self.look_all()
        finally:
            await self.transport.close()
        out = []
        for host, facts in seen.items():
            result = NodeResult(host)
            if isinstance(facts, NodeFailed):
                result.state, result.detail = "failed", facts.message
            else:
                result.before = facts.get("current")
                env = facts.get("envs", {}).get(result.before or "", {})
                result.after = env.get("hash")
                result.platform = f"{facts['python_tag']} {facts['machine']}"
                result.changes = differences(target.packages, env.get("packages", {}))
                result.state = "same" if result.after == target.hash else "differs"
                if result.before and result.after != result.before:
                    result.detail = (
                        f"{result.before} was changed by hand: it hashes to {result.after}"
                    )
            out.append(result)
        return out

    async def each_action(self, action: str, **args: Any) -> list[NodeResult]:
        async def one(node: NodeSpec) -> NodeResult:
            result = NodeResult(node.host)
            try:
                done = await self._action(
                    node, action, timeout=self.cluster.connect_timeout + 120, **args
                )
                result.state, result.detail = "done", json.dumps(done)
            except NodeFailed as exc:
                result.state, result.detail = "failed", exc.message
            return result

        try:
            return await self.transport.each(self.cluster.nodes, one)
        finally:
            await self.transport.close()


def _unpacked_size(path: Path) -> int:
    try:
        with zipfile.ZipFile(path) as wheel:
            return sum(info.file_size for info in wheel.infolist())
    except (OSError, zipfile.BadZipFile):
        return path.stat().st_size


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.1f} MiB"


async def _first_line(process: asyncio.subprocess.Process) -> dict[str, Any]:
    """The first JSON line a node side says ({} for anything else)."""
    assert process.stdout is not None
    line = await process.stdout.readline()
    try:
        said = json.loads(line) if line.startswith(b"{") else {}
    except ValueError:
        return {}
    return said if isinstance(said, dict) else {}


def _kill(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        try:
            process.kill()
        except ProcessLookupError:
            pass
