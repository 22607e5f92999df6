"""`herd sync [PATH]`: copy the project directory into every node's workdir with rsync over ssh.

What goes where: the contents of PATH (default ``.``) go into [cluster] workdir on each node
(``~/x`` is under the node's home); without a workdir, into the same absolute path as PATH.
``.gitignore`` files are honoured (rsync's ``:- .gitignore`` dir-merge rule), ``.git/`` and
``--exclude`` patterns are left out, nothing on the node is deleted unless ``--delete``.
rsync's quick check (size and modification time) makes a repeat of an unchanged tree cheap.

Shared filesystems are found, not assumed. A marker file written into PATH that shows up at
the node's workdir means the node sees this very directory: nothing to copy, the node is
skipped. Nodes then each write a marker into their workdir and list the others' markers:
nodes that see each other's share one filesystem (an NFS home, say), and only the first of
them is copied to. The markers are removed again at the end.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shlex
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..spec import ClusterSpec, NodeSpec
from ..transport import Transport, for_cluster
from ..transport.base import CommandResult

MARKER_PREFIX = ".herd-sync-"
DEFAULT_EXCLUDES = ("/.git/", f"{MARKER_PREFIX}*")

OnProgress = Callable[[str, int, int], None]
"""on_progress(host, percent, bytes so far) while rsync copies to that host."""


@dataclass(frozen=True)
class SyncResult:
    host: str
    status: str
    """copied, skipped, failed, unreachable."""
    bytes_sent: int = 0
    files: int = 0
    """Regular files rsync transferred (changed or new)."""
    duration: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("copied", "skipped")


def destination(cluster: ClusterSpec, source: Path) -> str:
    return cluster.workdir or str(source.resolve())


def rsync_path(path: str) -> str:
    """A node path as rsync's remote side takes it: ``~/x`` becomes ``x`` (relative to home)."""
    if path == "~":
        return "."
    if path.startswith("~/"):
        return path[2:] or "."
    return path


def rsync_argv(
    source: Path,
    host: str,
    dest: str,
    ssh_argv: Sequence[str],
    excludes: Sequence[str] = (),
    delete: bool = False,
) -> list[str]:
    rsync = shutil.which("rsync") or "rsync"
    target = f"[{host}]" if ":" in host and not host.startswith("[") else host
    argv = [
        rsync,
        "--archive",
        "--partial",
        "--no-inc-recursive",
        "--info=progress2",
        "--stats",
        "-e",
        shlex.join(ssh_argv),
        "--filter=:- .gitignore",
    ]
    argv += [f"--exclude={pattern}" for pattern in (*DEFAULT_EXCLUDES, *excludes)]
    if delete:
        argv.append("--delete")
    return [*argv, f"{source}/", f"{target}:{rsync_path(dest).rstrip('/') or '/'}/"]


def env_file_excludes(cluster: ClusterSpec, source: Path) -> list[str]:
    """The rsync rule that keeps the cluster's env_file (secrets) off the nodes, whatever
    .gitignore says: it reaches them only inside the job request, over ssh's stdin."""
    if not cluster.env_file:
        return []
    path = Path(os.path.expanduser(cluster.env_file)).resolve()
    try:
        relative = path.relative_to(source.resolve())
    except ValueError:
        return []  # outside the synced tree: never copied
    pattern = "/" + relative.as_posix()  # anchored at the transfer root
    if re.search(r"[*?\[]", pattern):
        # rsync reads these as wildcards; then (only then) a backslash escapes one.
        pattern = re.sub(r"([*?\[\\])", r"\\\1", pattern)
    return [pattern]


_STATS = {
    "bytes_sent": re.compile(r"Total bytes sent:\s*([\d,.]+)"),
    "files": re.compile(r"Number of regular files transferred:\s*([\d,.]+)"),
}
_PROGRESS = re.compile(rb"([\d,]+)\s+(\d+)%")


def parse_stats(text: str) -> dict[str, int]:
    found = {}
    for key, pattern in _STATS.items():
        match = pattern.search(text)
        found[key] = int(re.sub(r"[,.]", "", match.group(1))) if match else 0
    return found


def _shell_dir(variable: str = "$1") -> str:
    """sh text that sets d to a workdir with a leading ~ expanded on the node."""
    return f'd={variable}; case $d in "~") d=$HOME ;; "~/"*) d=$HOME/${{d#"~/"}} ;; esac; '


# $1 workdir, $2 launcher marker, $3 this node's marker
PREPARE = _shell_dir() + (
    'if [ -e "$d/$2" ]; then echo herd-same; exit 0; fi; '
    'mkdir -p "$d" && : > "$d/$3" && echo herd-ready'
)
# $1 workdir, $2 marker prefix of this sync
LIST = _shell_dir() + 'ls -A "$d" | grep -F -- "$2" || true'
CLEAN = _shell_dir() + 'rm -f "$d/$2"'


class Syncer:
    def __init__(
        self,
        cluster: ClusterSpec,
        source: Path,
        *,
        excludes: Sequence[str] = (),
        delete: bool = False,
        on_progress: OnProgress | None = None,
        transport: Transport | None = None,
    ) -> None:
        if cluster.transport == "slurm":
            raise ConfigError(
                f"herd sync copies over ssh, and {cluster.source} starts its agents with srun",
                "Slurm clusters share the filesystem: put the project there (the job runs in "
                "this directory on every node), or run herd sync outside the allocation",
            )
        if cluster.transport not in ("ssh", "pbs"):
            raise ConfigError(
                "herd sync copies to the nodes of a cluster, and there is none: this machine "
                "alone runs the job where it is",
                "describe your nodes with `herd init HOST...` (or pass -c FILE)",
            )
        if not source.is_dir():
            raise ConfigError(f"{source} is not a directory", "give the project directory")
        if shutil.which("rsync") is None:
            raise ConfigError(
                "rsync is not installed on this machine",
                "install it here and on the nodes (Debian/Ubuntu: apt-get install rsync)",
            )
        self.cluster = cluster
        self.source = source.resolve()
        self.dest = destination(cluster, source)
        self.excludes = list(excludes) + env_file_excludes(cluster, self.source)
        self.delete = delete
        self.on_progress = on_progress
        self.transport = transport or for_cluster(cluster)
        self.token = secrets.token_hex(6)

    def _marker(self, who: str) -> str:
        return f"{MARKER_PREFIX}{self.token}-{who}"

    async def run(self) -> list[SyncResult]:
        local_marker = self.source / self._marker("launcher")
        try:
            local_marker.touch()
        except OSError:
            local_marker = Path("/nonexistent")  # read-only source: assume nothing is shared
        marked: list[NodeSpec] = []
        try:
            return await self._run(local_marker.name, marked)
        finally:
            local_marker.unlink(missing_ok=True)
            await self.transport.each(marked, self._clean)
            await self.transport.close()

    async def _run(self, local_marker: str, marked: list[NodeSpec]) -> list[SyncResult]:
        nodes = list(self.cluster.nodes)
        index = {n.host: i for i, n in enumerate(nodes)}
        results: dict[str, SyncResult] = {}
        prepared = await self.transport.each(nodes, lambda n: self._prepare(n, local_marker))
        for node, outcome in zip(nodes, prepared, strict=True):
            if isinstance(outcome, SyncResult):
                results[node.host] = outcome
            elif outcome == "same":
                results[node.host] = SyncResult(
                    node.host, "skipped", detail="sees this directory (shared filesystem)"
                )
            else:
                marked.append(node)
        seen = await self.transport.each(marked, self._list)
        leaders: list[NodeSpec] = []
        for node, names in zip(marked, seen, strict=True):
            peers = [
                nodes[int(n.rsplit("-n", 1)[1])]
                for n in names
                if re.fullmatch(re.escape(self._marker("n")) + r"\d+", n)
            ]
            first = min(peers + [node], key=lambda n: index[n.host])
            if first is node:
                leaders.append(node)
            else:
                results[node.host] = SyncResult(
                    node.host, "skipped", detail=f"same filesystem as {first.host}"
                )
        for node, result in zip(
            leaders, await self.transport.each(leaders, self._rsync), strict=True
        ):
            results[node.host] = result
        return [results[n.host] for n in nodes]

    async def _prepare(self, node: NodeSpec, local_marker: str) -> str | SyncResult:
        started = time.monotonic()
        unreachable = await self.transport.connect(node)
        if unreachable is not None:
            return SyncResult(
                node.host,
                "unreachable",
                duration=time.monotonic() - started,
                detail=f"{unreachable.describe()}; fix: {unreachable.remedy}",
            )
        mine = self._marker(f"n{self.cluster.nodes.index(node)}")
        result = await self._sh(node, PREPARE, self.dest, local_marker, mine)
        if result.ok and "herd-same" in result.stdout:
            return "same"
        if result.ok and "herd-ready" in result.stdout:
            return "ready"
        return SyncResult(
            node.host,
            "failed",
            duration=time.monotonic() - started,
            detail=f"cannot create {self.dest} there: {_last(result)}",
        )

    async def _list(self, node: NodeSpec) -> list[str]:
        result = await self._sh(node, LIST, self.dest, f"{MARKER_PREFIX}{self.token}-")
        return result.stdout.split() if result.ok else []

    async def _clean(self, node: NodeSpec) -> None:
        await self._sh(node, CLEAN, self.dest, self._marker(f"n{self.cluster.nodes.index(node)}"))

    async def _sh(self, node: NodeSpec, script: str, *args: str) -> CommandResult:
        argv = ["sh", "-c", script, "herd-sync", *args]
        return await self.transport.run(node, argv, timeout=self.cluster.connect_timeout + 30)

    async def _rsync(self, node: NodeSpec) -> SyncResult:
        started = time.monotonic()
        base_argv = getattr(self.transport, "base_argv", None)
        ssh_argv = base_argv(node) if base_argv is not None else ["ssh"]
        argv = rsync_argv(self.source, node.host, self.dest, ssh_argv, self.excludes, self.delete)
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None and process.stderr is not None
        output, errors = await asyncio.gather(
            self._read_progress(node.host, process.stdout), process.stderr.read()
        )
        code = await process.wait()
        duration = time.monotonic() - started
        stderr = errors.decode(errors="replace")
        if code != 0:
            return SyncResult(
                node.host,
                "failed",
                duration=duration,
                detail=_rsync_failure(node.host, code, stderr),
            )
        stats = parse_stats(output)
        return SyncResult(node.host, "copied", stats["bytes_sent"], stats["files"], duration)

    async def _read_progress(self, host: str, stream: asyncio.StreamReader) -> str:
        kept = bytearray()
        while chunk := await stream.read(1 << 14):
            kept += chunk
            if self.on_progress is not None:
                updates = _PROGRESS.findall(bytes(chunk))
                if updates:
                    done, percent = updates[-1]
                    self.on_progress(host, int(percent), int(done.replace(b",", b"")))
        return kept.decode(errors="replace")


def _last(result: CommandResult) -> str:
    lines = (result.stderr or result.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {result.returncode}"


def _rsync_failure(host: str, code: int, stderr: str) -> str:
    if "command not found" in stderr or "rsync: not found" in stderr or code == 127:
        return f"rsync is not installed on {host}; fix: install it there (apt-get install rsync)"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return f"rsync exited with {code}: {lines[0] if lines else 'no message'}"


def sync(
    cluster: ClusterSpec,
    source: Path,
    *,
    excludes: Sequence[str] = (),
    delete: bool = False,
    on_progress: OnProgress | None = None,
) -> list[SyncResult]:
    """Copy ``source`` into every node's workdir; one result per node, in cluster order."""
    syncer = Syncer(cluster, source, excludes=excludes, delete=delete, on_progress=on_progress)
    return asyncio.run(syncer.run())


__all__ = ["SyncResult", "Syncer", "destination", "parse_stats", "rsync_argv", "sync"]
