"""What the cluster is: ClusterSpec / NodeSpec and their loaders.

Sources: ``herd.toml``, DeepSpeed/MPI hostfiles (``host slots=N``), Horovod-style host lists
(``h1:4,h2:2``) and Slurm node lists (``gpu[01-04,07]``). Every loader returns a validated,
immutable ClusterSpec or raises ConfigError naming the file, the line or field, and the fix.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from .errors import ConfigError

DEFAULT_CLUSTER_FILE = "herd.toml"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
IFACE_NAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")
# What a host may be: an ssh alias or DNS name, an IPv4 or (bracketed or bare) IPv6 address,
# with an optional user. Nothing a shell, a terminal or ssh's option parser would read as more.
HOST_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,252}$")
USER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
HOST_HELP = (
    "must be an ssh destination: a name or alias (letters, digits, '.', '-', '_'), an IPv4 "
    "address, or an IPv6 address (bare or in [brackets]), optionally with user@ in front, "
    "such as gpu1, 10.0.0.7, alice@gpu1 or [fe80::1]"
)


def check_host(value: str) -> str:
    """``value`` as a valid ssh destination (IPv6 brackets dropped), or ValueError saying why."""
    user, at, host = value.strip().rpartition("@")
    if at and not USER_NAME.match(user):
        raise ValueError(f"{HOST_HELP}; {user!r} is not a user name")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        bracketed = True
    else:
        bracketed = False
    if ":" in host or bracketed:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            if not bracketed and host.count(":") == 1 and host.rsplit(":", 1)[1].isdigit():
                raise ValueError(
                    f"{HOST_HELP}; a port does not go here: set it in your ssh config "
                    f"(`Host {host.split(':')[0]}` / `Port {host.rsplit(':', 1)[1]}`)"
                ) from None
            raise ValueError(HOST_HELP) from None
    elif not HOST_NAME.match(host):
        raise ValueError(HOST_HELP)
    return f"{user}@{host}" if at else host


def node_name(host: str) -> str:
    """A host without its ``user@`` part, lower-cased: two entries with the same one are the
    same machine (they would share a node directory and a job tag)."""
    return host.rsplit("@", 1)[-1].lower()


class NodeSpec(BaseModel):
    """One machine of the cluster, as the user described it."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    host: str
    """ssh destination: an alias from ssh_config, a name or an address; user@host allowed."""
    nproc: int | None = Field(default=None, ge=1, le=1024)
    """Workers on this node; default: its GPU count (1 if none)."""
    addr: str | None = None
    """Address the other nodes reach this node at; default: found by probing."""
    iface: str | None = None
    """NIC for NCCL/Gloo; default: the one on the route to the rendezvous host."""
    python: str | None = None
    """Interpreter on this node, where it differs from [cluster] python."""
    setup: str | None = None
    """Shell commands run before this node's agent starts, after [cluster] setup."""
    spare: bool = False
    """A hot spare: checked and warmed with the others, but takes no rank; when a node is
    lost, a spare with as many workers takes its place and the world size stays the same."""

    @field_validator("host")
    @classmethod
    def _host_is_a_destination(cls, value: str) -> str:
        return check_host(value)

    @field_validator("addr")
    @classmethod
    def _addr_is_an_address(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return str(ipaddress.ip_address(value.strip()))
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address (write it like 10.0.0.7)") from None

    @field_validator("iface")
    @classmethod
    def _iface_is_a_name(cls, value: str | None) -> str | None:
        if value is not None and not IFACE_NAME.match(value):
            raise ValueError(f"{value!r} is not a network interface name (like eth0 or ib0)")
        return value

    @property
    def name(self) -> str:
        """The host without its ``user@`` part: what logs and tables call this node."""
        return self.host.rsplit("@", 1)[-1]


class ClusterSpec(BaseModel):
    """The whole cluster: shared settings plus the nodes, first node hosting the rendezvous."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)
    _index: tuple[tuple[NodeSpec, ...] | None, dict[str, NodeSpec]] = PrivateAttr(
        default=(None, {})
    )

    nodes: tuple[NodeSpec, ...]
    """The machines; the first one hosts the rendezvous store."""
    transport: Literal["ssh", "local", "slurm", "pbs"] = "ssh"
    """How node agents are started: over ssh, as a local process (this machine alone), or inside
    a Slurm or PBS allocation (srun; ssh between the allocated nodes)."""
    python: str = "python3"
    """Interpreter on the nodes; default: python3 on the remote PATH."""
    workdir: str | None = None
    """The job's working directory on the nodes; default: the launcher's current directory."""
    ssh_config: str | None = None
    """File passed to ``ssh -F``; default: the user's own ~/.ssh/config."""
    env: dict[str, str] = Field(default_factory=dict)
    """Variables exported on every node."""
    env_file: str | None = None
    """KEY=VALUE file of secrets, sent over ssh's stdin, never on a command line or in a log."""
    connect_timeout: float = Field(default=10.0, gt=0, le=600)
    """Seconds ssh waits for a node to answer before calling it unreachable."""
    rdzv_port: int | None = Field(default=None, ge=1024, le=65535)
    """Rendezvous port on the first node; default: a free port found at launch."""
    allow_public_rendezvous: bool = False
    """Allow a public rendezvous address (the c10d store has no authentication)."""
    rendezvous: Literal["static", "c10d"] = "static"
    """How the nodes of an attempt meet: "static" (node ranks from herd's plan, one TCP store on
    the first node: no elastic round, faster) or "c10d" (torchrun's elastic rendezvous)."""
    min_nodes: int | None = Field(default=None, ge=1)
    """On a restart, go on without lost nodes while at least this many answer (default: all)."""
    launcher_silence: float = Field(default=90.0, ge=5, le=3600)
    """Seconds the nodes' agents keep the job running while they hear nothing from the
    launcher (stopped, suspended, cut off by the network) before they stop it themselves."""
    link_silence: float = Field(default=10.0, ge=4, le=600)
    """Seconds without a word from a node's agent (not even its 2-s "alive") after which herd
    calls the node lost; while the other nodes' ranks still step (so its ranks take part in
    their collectives), up to launcher_silence."""
    tree_above: int | None = Field(default=None, ge=1)
    """Over ssh, a launch of more nodes than this starts the agents through a tree: ssh from
    the launcher to a few inner nodes only (the last, one per 33 nodes), which start the
    others over their own ssh; every node's agent still links straight back to the launcher.
    Off unless set: those links are plain TCP, not encrypted as ssh is."""
    setup: str | None = None
    """Shell commands run in the shell that starts each node's agent, e.g.
    "module load cuda/12.6 && source ~/venv/bin/activate"; a failure stops the launch."""
    env_sync: bool = False
    """herd launch makes every node's Python environment the one of env_lock before it starts
    (as `herd env sync`, only on the nodes whose hash differs) and runs the job in it."""
    env_lock: str | None = None
    """uv.lock or pinned requirements file of that environment; default: ./uv.lock, else the
    launcher's own environment."""
    env_wheels: list[str] = Field(default_factory=list)
    """Folders of wheels taken first for env_sync (what is missing is fetched once with pip)."""
    env_root: str | None = None
    """Node-local folder for environments and their caches; default: ~/.herd/envs, inside a
    Slurm or PBS allocation the node's own scratch (``$TMPDIR``, else /tmp)."""
    carry_env: dict[str, str] = Field(default_factory=dict)
    """Inside an allocation: the launcher's variables sent to every agent (PATH, venv, NCCL_*)."""
    scheduler_job_id: str | None = None
    """Inside an allocation: the scheduler's job id."""
    source: str = "command line"
    """Where this spec came from, for messages."""

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return value

    @field_validator("nodes")
    @classmethod
    def _nodes_unique(cls, value: tuple[NodeSpec, ...]) -> tuple[NodeSpec, ...]:
        if not value:
            raise ValueError("no nodes: add at least one [[node]] with a host")
        seen: dict[str, str] = {}
        for node in value:
            name = node_name(node.host)
            if name in seen:
                raise ValueError(
                    f"duplicate host {node.host!r}: the same node as {seen[name]!r}; "
                    "list each node once"
                )
            seen[name] = node.host
        if all(node.spare for node in value):
            raise ValueError("every node is a spare: at least one node must run the job")
        return value

    @property
    def rendezvous_node(self) -> NodeSpec:
        """The first node that runs the job: it hosts the c10d store. (Found without building
        ``active``: the start asks for it once per node, and a tuple of every node each time
        made that quadratic in the node count.)"""
        return next(node for node in self.nodes if not node.spare)

    @property
    def active(self) -> tuple[NodeSpec, ...]:
        """The nodes that run the job (every node but the spares)."""
        return tuple(node for node in self.nodes if not node.spare)

    @property
    def spares(self) -> tuple[NodeSpec, ...]:
        return tuple(node for node in self.nodes if node.spare)

    def with_spares(self, count: int) -> ClusterSpec:
        """A copy whose last ``count`` nodes are spares (``--spares N``, for hostfiles and
        scheduler allocations, which cannot say ``spare = true``)."""
        if count <= 0:
            return self
        if count >= len(self.nodes):
            raise ConfigError(
                f"--spares {count} leaves no node to run the job ({len(self.nodes)} node(s) in "
                f"{self.source})",
                f"give at most --spares {len(self.nodes) - 1}",
            )
        keep = len(self.nodes) - count
        nodes = tuple(
            node if index < keep else node.model_copy(update={"spare": True})
            for index, node in enumerate(self.nodes)
        )
        return self.model_copy(update={"nodes": nodes})

    def with_workdir(self) -> ClusterSpec:
        """The job runs in [cluster] workdir, or else in the launcher's current directory (the
        same path on every node: a shared filesystem or a `herd sync`ed copy)."""
        if self.workdir:
            return self
        return self.model_copy(update={"workdir": os.getcwd()})

    def python_for(self, node: NodeSpec) -> str:
        return node.python or self.python

    def setup_for(self, node: NodeSpec) -> str | None:
        """The setup prelude for a node: [cluster] setup, then the node's own."""
        parts = [part.strip() for part in (self.setup, node.setup) if part and part.strip()]
        if len(parts) < 2:
            return parts[0] if parts else None
        # The node's part runs only when the cluster's succeeded.
        return " && ".join(f"{{ {part}\n}}" for part in parts)

    def node(self, host: str) -> NodeSpec:
        found = self._node_index().get(host)
        if found is not None:
            return found
        raise ConfigError(
            f"{host!r} is not a node of {self.source}",
            f"use one of: {', '.join(n.host for n in self.nodes)}",
        )

    def _node_index(self) -> dict[str, NodeSpec]:
        """Each node by its host and by its name (the first node wins a clash, as a scan in
        order would): a launch looks nodes up once per node and event, which over a list
        costs O(N) each at 1,000 nodes. Kept with the tuple it was made from, since a copy
        with other nodes (model_copy) carries this private value over."""
        made_from, index = self._index
        if made_from is not self.nodes:
            index = {}
            for node in self.nodes:
                index.setdefault(node.host, node)
                index.setdefault(node.name, node)
            self._index = (self.nodes, index)
        return index

    def select(self, hosts: Iterable[str]) -> ClusterSpec:
        """A copy holding only the named nodes (in the cluster's order), none of them a spare:
        the job runs on them (a spare chosen to replace a lost node runs like any other)."""
        wanted = {self.node(h).host for h in hosts}
        return self.model_copy(
            update={
                "nodes": tuple(
                    n.model_copy(update={"spare": False}) for n in self.nodes if n.host in wanted
                )
            }
        )


def _build_without_pydantic_plugins(*models: type[BaseModel]) -> None:
    """Build the models' validators now, with pydantic's plugin scan off.

    The first model pydantic builds in a process looks for plugins in every installed
    distribution's entry points: ~70 ms of each herd command's start (more with a large
    environment), for observability plugins that a cluster file's two models have no use for.
    The setting is put back at once, so a model of the user's in a process that imported herd
    still finds its plugins (pydantic scans on that model's first build)."""
    before = os.environ.get("PYDANTIC_DISABLE_PLUGINS")
    os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"
    try:
        for model in models:
            model.model_rebuild(force=True)
    finally:
        if before is None:
            del os.environ["PYDANTIC_DISABLE_PLUGINS"]
        else:
            os.environ["PYDANTIC_DISABLE_PLUGINS"] = before


_build_without_pydantic_plugins(NodeSpec, ClusterSpec)


def local_cluster(nproc: int | None = None) -> ClusterSpec:
    """This machine alone, without ssh: what ``herd launch`` uses when there is no cluster file."""
    return ClusterSpec(
        nodes=(NodeSpec(host="localhost", nproc=nproc),),
        transport="local",
        python=os.environ.get("HERD_PYTHON", "") or _this_python(),
        source="this machine (no herd.toml)",
    )


def _this_python() -> str:
    import sys

    return sys.executable or "python3"


# ---------------------------------------------------------------------------------------------
# herd.toml

# Fields a herd.toml may set; the rest are filled in by herd (an allocation, the loader).
CLUSTER_KEYS = {
    name
    for name in ClusterSpec.model_fields
    if name not in ("nodes", "transport", "source", "carry_env", "scheduler_job_id")
}
NODE_KEYS = set(NodeSpec.model_fields)


def load_cluster_file(path: str | os.PathLike[str]) -> ClusterSpec:
    """Read and validate a herd.toml. Relative paths inside it are relative to its folder."""
    path = Path(path)
    text = read_text_file(
        path, "cluster file", "create one with `herd init HOST...`, or pass another with -c FILE"
    )
    if path.suffix != ".toml" and _looks_like_hostfile(text):
        # DeepSpeed/MPI hostfiles are accepted wherever a cluster file is.
        return load_hostfile(path)
    return parse_cluster_toml(text, str(path), base_dir=path.parent)


def _looks_like_hostfile(text: str) -> bool:
    """TOML needs [tables] or `key = value`; a hostfile line is `HOST [slots=N]`."""
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    return bool(lines) and not any(line.startswith("[") or " = " in line for line in lines)


def parse_cluster_toml(text: str, source: str, base_dir: Path | None = None) -> ClusterSpec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"{source}: not valid TOML: {exc}",
            "fix the syntax at that line (strings need quotes, tables look like [cluster])",
        ) from None
    locate = _LineFinder(text)

    unknown = set(data) - {"cluster", "node"}
    for key in sorted(unknown):
        raise ConfigError(
            f"{source} line {locate.top_level(key)}: unknown section or key {key!r}",
            _suggest(
                key, {"cluster", "node"}, "the file has a [cluster] table and [[node]] tables"
            ),
        )
    cluster = data.get("cluster", {})
    if not isinstance(cluster, dict):
        raise ConfigError(f"{source}: 'cluster' must be a table", "write it as [cluster]")
    nodes = data.get("node", [])
    if not isinstance(nodes, list) or not all(isinstance(n, dict) for n in nodes):
        raise ConfigError(f"{source}: 'node' must be an array of tables", "write each as [[node]]")
    if not nodes:
        raise ConfigError(
            f"{source}: no nodes",
            'add one [[node]] table per machine, e.g.\n  [[node]]\n  host = "gpu1"',
        )

    for key in cluster:
        if key not in CLUSTER_KEYS:
            raise ConfigError(
                f"{source} line {locate.key('cluster', 0, key)}: unknown key {key!r} in [cluster]",
                _suggest(key, CLUSTER_KEYS, "allowed keys: " + ", ".join(sorted(CLUSTER_KEYS))),
            )
    for index, node in enumerate(nodes):
        for key in node:
            if key not in NODE_KEYS:
                raise ConfigError(
                    f"{source} line {locate.key('node', index, key)}: unknown key {key!r} "
                    f"in [[node]] #{index + 1}",
                    _suggest(key, NODE_KEYS, "allowed keys: " + ", ".join(sorted(NODE_KEYS))),
                )

    # Lines are looked up only for the error: finding one reads every section of the file,
    # which for every node of a 1,000-node file took the launcher ~2 s.
    first_index: dict[str, int] = {}
    for index, node in enumerate(nodes):
        host = node.get("host")
        if not isinstance(host, str):
            continue
        name = node_name(host.strip())
        if name in first_index:
            line = locate.key("node", index, "host")
            first_line = locate.key("node", first_index[name], "host")
            raise ConfigError(
                f"{source} line {line}: [[node]] #{index + 1}: duplicate host {host!r}, the "
                f"same node as the host on line {first_line}",
                "list each node once (a user@ in front does not make another node)",
            )
        first_index[name] = index

    fields = dict(cluster)
    if base_dir is not None:
        for key in ("ssh_config", "env_file", "env_lock"):
            if isinstance(fields.get(key), str):
                fields[key] = str(_relative_to(base_dir, fields[key]))
        if isinstance(fields.get("env_wheels"), list):
            fields["env_wheels"] = [
                str(_relative_to(base_dir, f)) if isinstance(f, str) else f
                for f in fields["env_wheels"]
            ]
    try:
        return ClusterSpec(nodes=tuple(nodes), source=source, **fields)
    except ValidationError as exc:
        raise _config_error_from_validation(exc, source, locate, nodes) from None


def _relative_to(base_dir: Path, value: str) -> Path:
    expanded = Path(os.path.expanduser(value))
    return expanded if expanded.is_absolute() else (base_dir / expanded)


def _config_error_from_validation(
    exc: ValidationError, source: str, locate: _LineFinder, nodes: list[dict[str, Any]]
) -> ConfigError:
    error = exc.errors()[0]
    loc = error["loc"]
    message = error["msg"].removeprefix("Value error, ")
    if loc and loc[0] == "nodes":
        if len(loc) >= 3:
            index, key = int(loc[1]), str(loc[2])
            got = nodes[index].get(key)
            line = locate.key("node", index, key)
            where = f"{source} line {line}: [[node]] #{index + 1} {key} = {got!r}"
        elif len(loc) == 2:
            index = int(loc[1])
            where = f"{source} [[node]] #{index + 1}"
        else:
            where = source
        return ConfigError(f"{where}: {message}", _remedy_for(message, loc))
    key = str(loc[0]) if loc else "?"
    line = locate.key("cluster", 0, key)
    return ConfigError(
        f"{source} line {line}: [cluster] {key}: {message}", _remedy_for(message, loc)
    )


def _remedy_for(message: str, loc: tuple[Any, ...]) -> str:
    field = str(loc[-1]) if loc else ""
    doc = NodeSpec.model_fields.get(field) or ClusterSpec.model_fields.get(field)
    description = (doc.description if doc is not None else None) or ""
    if "host" in message and "duplicate" in message:
        return "remove the repeated [[node]] table, or give it nproc in one place"
    if field == "host":
        return (
            "write the host as ssh takes it: HOST or user@HOST (a port belongs in your ssh config)"
        )
    if field == "nproc":
        return "nproc is the number of workers on that node: a whole number, 1 or more"
    if description:
        return f"{field}: {description}"
    return "see the herd.toml reference in the README"


def _suggest(key: str, allowed: Iterable[str], fallback: str) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1)
    return f"did you mean {close[0]!r}? ({fallback})" if close else fallback


class _LineFinder:
    """Finds the line of a key in TOML text, so errors can point at it (tomllib gives no lines)."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()

    def _sections(self) -> list[tuple[str, int]]:
        found = []
        for number, line in enumerate(self.lines, start=1):
            stripped = line.strip()
            match = re.match(r"^\[\[?\s*([A-Za-z0-9_.-]+)\s*\]\]?", stripped)
            if match:
                found.append((match.group(1), number))
        return found

    def top_level(self, key: str) -> int:
        for name, number in self._sections():
            if name == key:
                return number
        return self._key_between(key, 0, len(self.lines)) or 1

    def key(self, section: str, index: int, key: str) -> int:
        sections = self._sections()
        starts = [number for name, number in sections if name == section]
        if index >= len(starts):
            return 1
        start = starts[index]
        later = [number for _, number in sections if number > start]
        end = later[0] - 1 if later else len(self.lines)
        return self._key_between(key, start, end) or start

    def _key_between(self, key: str, start: int, end: int) -> int | None:
        pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
        for number in range(start + 1, end + 1):
            if pattern.match(self.lines[number - 1]):
                return number
        return None


# ---------------------------------------------------------------------------------------------
# Hostfiles, host lists, Slurm node lists


def load_hostfile(path: str | os.PathLike[str], **cluster: Any) -> ClusterSpec:
    """Read a DeepSpeed/MPI hostfile: ``host slots=N`` per line, ``#`` comments, blank lines."""
    path = Path(path)
    text = read_text_file(path, "hostfile", "check the path")
    return parse_hostfile(text, str(path), **cluster)


def parse_hostfile(text: str, source: str, **cluster: Any) -> ClusterSpec:
    nodes: list[NodeSpec] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *options = line.split()
        nproc: int | None = None
        for option in options:
            key, sep, value = option.partition("=")
            if key in ("slots", "max_slots", "max-slots") and sep and value.isdigit():
                if key == "slots":
                    nproc = int(value)
                continue
            raise ConfigError(
                f"{source} line {number}: cannot read {option!r}",
                "write each line as `HOST slots=N` (N workers on HOST), or just `HOST`",
            )
        if nproc is not None and nproc < 1:
            raise ConfigError(f"{source} line {number}: slots must be 1 or more", "use slots=1")
        node = _node(host, nproc, f"{source} line {number}")
        name = node_name(node.host)
        if name in seen:
            raise ConfigError(
                f"{source} line {number}: host {host!r} is the same node as line {seen[name]}",
                "list each host once (a user@ in front does not make another node)",
            )
        seen[name] = number
        nodes.append(node)
    if not nodes:
        raise ConfigError(f"{source}: no hosts", "write one `HOST slots=N` line per machine")
    return _cluster(nodes, source, cluster)


def parse_host_list(text: str, source: str = "host list", **cluster: Any) -> ClusterSpec:
    """Read ``h1:4,h2:2,user@h3`` (Horovod's -H); ``HOST:N`` means N workers on HOST."""
    nodes: list[NodeSpec] = []
    for item in (part.strip() for part in text.replace(" ", ",").split(",")):
        if not item:
            continue
        nodes.append(parse_host_item(item, source))
    if not nodes:
        raise ConfigError(f"{source}: no hosts", "give hosts like gpu1:4,gpu2:4")
    return _cluster(nodes, source, cluster)


def parse_host_item(item: str, source: str = "host list") -> NodeSpec:
    """``gpu1``, ``gpu1:4``, ``alice@gpu1:4``, ``[fe80::1]:2`` -> NodeSpec."""
    host, nproc = item, None
    bracketed = re.match(r"^(.*\[[^\]]+\])(?::(\d+))?$", item)
    if bracketed:
        host = bracketed.group(1).replace("[", "").replace("]", "")
        nproc = int(bracketed.group(2)) if bracketed.group(2) else None
    elif item.count(":") == 1:
        host, _, count = item.partition(":")
        if not count.isdigit():
            raise ConfigError(
                f"{source}: {item!r}: the part after ':' must be a worker count",
                "write HOST:N, for example gpu1:4",
            )
        nproc = int(count)
        if nproc < 1:
            raise ConfigError(f"{source}: {item!r}: worker count must be 1 or more", "use HOST:1")
    return _node(host, nproc, source)


def _node(host: str, nproc: int | None, where: str) -> NodeSpec:
    try:
        return NodeSpec(host=host, nproc=nproc)
    except ValidationError as exc:
        message = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(
            f"{where}: {host!r}: {message}",
            "write the host as ssh would take it (HOST or user@HOST; a port belongs in your "
            "ssh config)",
        ) from None


def _cluster(nodes: list[NodeSpec], source: str, cluster: Mapping[str, Any]) -> ClusterSpec:
    try:
        return ClusterSpec(nodes=tuple(nodes), source=source, **cluster)
    except ValidationError as exc:
        message = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{source}: {message}", "list each host once") from None


def expand_nodelist(text: str) -> list[str]:
    """Expand a Slurm node list: ``gpu[01-03,07],cpu1`` -> gpu01 gpu02 gpu03 gpu07 cpu1."""
    from .hostlist import expand_hostlist

    return expand_hostlist(text)


# ---------------------------------------------------------------------------------------------
# Secrets


def read_env_file(
    path: str | os.PathLike[str], warn: Callable[[str, str], None] | None = None
) -> dict[str, str]:
    """Read a KEY=VALUE file (``export`` and quotes allowed, ``#`` comments). Values are secrets.

    ``warn(message, fix)`` hears about a file other users can read (default: stderr).
    """
    path = Path(path)
    text = read_text_file(path, "env_file", "check env_file in herd.toml")
    exposed = _readable_by_others(path)
    if exposed:
        (warn or _warn_on_stderr)(
            f"env_file {path} is readable by {exposed} (it holds secrets; s3fs and other "
            "tools refuse such a file)",
            f"chmod 600 {path}",
        )
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        key = key.strip()
        parsed = _env_value(value.strip()) if sep else None
        if parsed is None or not ENV_NAME.match(key):
            raise ConfigError(
                f"{path} line {number}: expected KEY=VALUE",
                "write one variable per line, like HF_TOKEN=abc123 (quote a value with "
                "spaces or a closing quote: KEY='a b')",
            )
        values[key] = parsed
    return values


def _env_value(value: str) -> str | None:
    """The value of one line, as shells and dotenv read it: a quoted value is what is between
    its quotes (a ``#`` inside is kept); an unquoted one ends at `` #`` (an inline comment)."""
    if value[:1] in ("'", '"'):
        end = value.find(value[0], 1)
        if end < 0:
            return None
        rest = value[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            return None
        return value[1:end]
    return re.split(r"\s#", value, maxsplit=1)[0].strip()


def _readable_by_others(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except OSError:
        return ""
    who = [name for bit, name in ((0o040, "its group"), (0o004, "every user")) if mode & bit]
    return " and ".join(who)


def _warn_on_stderr(message: str, fix: str) -> None:
    import sys

    print(f"warning: {message}\n  fix: {fix}", file=sys.stderr)


def read_text_file(path: Path, what: str, remedy: str) -> str:
    """A UTF-8 text file for a loader, or a ConfigError saying why it cannot be read
    (``remedy``: what to do when it does not exist)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist", remedy) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{what} {path} is not UTF-8 text (byte {exc.start}: {exc.reason})",
            f"save it as UTF-8 (e.g. `iconv -f LATIN1 -t UTF-8 {path} > {path}.utf8`, then "
            "use that file)",
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"cannot read {what} {path}: {exc.strerror or exc}",
            f"check that it is a file you can read (`ls -l {path}`)",
        ) from None


SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def find_cluster(path: str | None) -> ClusterSpec | None:
    """The cluster for a command: ``-c FILE``, else ./herd.toml, else None (this machine alone)."""
    if path:
        return load_cluster_file(path)
    if Path(DEFAULT_CLUSTER_FILE).is_file():
        return load_cluster_file(DEFAULT_CLUSTER_FILE)
    return None
