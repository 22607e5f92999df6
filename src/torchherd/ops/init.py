"""`herd init`: write a herd.toml from a host list or a hostfile, optionally probing GPU counts.

The file is rendered as text (with the common optional keys as comments, so the file teaches
its own format), parsed back with the real loader before it is written, and never replaces an
existing file unless asked to.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, cannot_write
from ..spec import ClusterSpec, NodeSpec, load_hostfile, parse_cluster_toml, parse_host_list
from ..transport import for_cluster

# GPU names, one line per GPU: nvidia-smi where it exists, else the device files.
GPU_SCRIPT = (
    "if command -v nvidia-smi >/dev/null 2>&1 && "
    "nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep .; then :; "
    "else ls -d /dev/nvidia[0-9]* 2>/dev/null; fi; true"
)

HEADER = """\
# The cluster `herd` runs on (written by `herd init`; edit freely, then `herd doctor`).
# The first node hosts the rendezvous. Every key is listed below (commented out where unset)
# and explained in torchherd's README, section "herd.toml"; a mistyped key is an error that
# names the line and the key meant.
"""

# Every [cluster] key (spec.CLUSTER_KEYS), commented out, with what it does.
CLUSTER_HINTS = """\
# python = "/opt/venv/bin/python"   # interpreter on the nodes (default: python3)
# workdir = "~/project"             # where `herd sync` copies the project and jobs run
# env = { NCCL_DEBUG = "WARN" }     # exported on every node
# env_file = ".env"                 # secrets: sent over ssh's stdin, never on a command line
# ssh_config = "ssh_config"         # passed to ssh -F (default: your ~/.ssh/config)
# setup = "module load cuda"        # shell commands before each node's agent starts
# env_sync = true                   # herd launch syncs the nodes' Python environment first
# env_lock = "uv.lock"              # ... to this lock (default: ./uv.lock, else this env)
# env_wheels = ["wheels"]           # ... taking wheels from these folders first
# env_root = "/local/herd-envs"     # ... built under this node-local folder
# connect_timeout = 10              # seconds before a silent node is unreachable
# rdzv_port = 29500                 # rendezvous port on the first node (default: a free one)
# min_nodes = 2                     # on a restart, go on without lost nodes while this many remain
# allow_public_rendezvous = false   # the c10d store has no authentication: keep it private
# rendezvous = "static"             # node ranks from herd's plan ("c10d": torchrun's elastic round)
# launcher_silence = 90             # seconds a node runs on without hearing herd (a stalled
#                                   # launcher, a suspended laptop), then it stops its share
# link_silence = 10                 # seconds of a node's silence before herd calls it lost
#                                   # (longer while the others still step)
# tree_above = 64                   # more nodes than this: ssh to a few inner nodes only,
#                                   # which start the rest (every node links back to herd
#                                   # over plain TCP: off unless set)
"""


@dataclass(frozen=True)
class GpuProbe:
    host: str
    count: int | None
    """GPUs found; None when the node could not be asked."""
    names: tuple[str, ...] = ()
    error: str = ""


def nodes_from(hosts: Sequence[str], hostfile: str | None) -> ClusterSpec:
    """The nodes named on the command line (HOST[:NPROC], commas allowed) or in a hostfile."""
    if hosts and hostfile:
        raise ConfigError("give hosts or --hostfile, not both", "drop one of them")
    if hostfile:
        return load_hostfile(hostfile)
    if not hosts:
        raise ConfigError(
            "no hosts given", "herd init gpu1 gpu2:4 10.0.0.7, or herd init --hostfile FILE"
        )
    return parse_host_list(",".join(hosts), source="command line")


def toml_string(value: str) -> str:
    escaped = []
    for ch in value:
        if ch in '"\\':
            escaped.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            escaped.append(f"\\u{ord(ch):04x}")
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'


def render(
    nodes: Sequence[NodeSpec],
    *,
    python: str | None = None,
    workdir: str | None = None,
    ssh_config: str | None = None,
    comments: dict[str, str] | None = None,
) -> str:
    """herd.toml text for these nodes; ``comments`` adds a note after a node's host line."""
    lines = [HEADER, "[cluster]"]
    for key, value in (("python", python), ("workdir", workdir), ("ssh_config", ssh_config)):
        if value:
            lines.append(f"{key} = {toml_string(value)}")
    lines.append(CLUSTER_HINTS)
    for node in nodes:
        lines.append("[[node]]")
        note = (comments or {}).get(node.host)
        lines.append(f"host = {toml_string(node.host)}" + (f"  # {note}" if note else ""))
        if node.nproc is not None:
            lines.append(f"nproc = {node.nproc}")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def probe_gpus(cluster: ClusterSpec) -> list[GpuProbe]:
    """Each node's GPUs over ssh, with plain shell: torchherd need not be installed yet."""

    async def main() -> list[GpuProbe]:
        transport = for_cluster(cluster)

        async def one(node: NodeSpec) -> GpuProbe:
            unreachable = await transport.connect(node)
            if unreachable is not None:
                return GpuProbe(
                    node.host, None, error=f"{unreachable.describe()}; fix: {unreachable.remedy}"
                )
            result = await transport.run(node, ["sh", "-c", GPU_SCRIPT], timeout=60)
            if not result.ok:
                return GpuProbe(
                    node.host,
                    None,
                    error=f"{node.host}: the GPU probe failed: "
                    f"{result.stderr.strip() or result.returncode}",
                )
            names = tuple(line.strip() for line in result.stdout.splitlines() if line.strip())
            return GpuProbe(node.host, len(names), names)

        try:
            return await transport.each(cluster.nodes, one)
        finally:
            await transport.close()

    return asyncio.run(main())


def describe_gpus(probe: GpuProbe) -> str:
    if not probe.count:
        return "no GPU found"
    name, _ = collections.Counter(probe.names).most_common(1)[0]
    if re.fullmatch(r"/dev/nvidia\d+", name):  # found by device file: no model name
        return f"{probe.count} GPU(s)"
    return f"{probe.count} × {name}"


def with_probed_nproc(cluster: ClusterSpec, probes: Sequence[GpuProbe]) -> list[NodeSpec]:
    """Nodes with nproc filled from their GPU count (1 without GPUs); given counts are kept."""
    counts = {p.host: p.count for p in probes}
    nodes = []
    for node in cluster.nodes:
        count = counts.get(node.host)
        if node.nproc is None and count is not None:
            node = node.model_copy(update={"nproc": count or 1})
        nodes.append(node)
    return nodes


def write_cluster_file(path: Path, text: str, *, force: bool = False) -> None:
    """Validate ``text`` with the real loader, then write it; never overwrite without force."""
    parse_cluster_toml(text, str(path), base_dir=path.parent)
    if path.exists() and not force:
        raise ConfigError(
            f"{path} already exists",
            "pass --force to replace it, or -o OTHER.toml to write elsewhere",
        )
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise cannot_write(path, exc) from None
    if force:
        os.replace(temporary, path)
        return
    try:
        os.link(temporary, path)  # fails if the file appeared meanwhile: never clobber it
    except FileExistsError:
        raise ConfigError(f"{path} already exists", "pass --force to replace it") from None
    except OSError:
        os.replace(temporary, path)  # a filesystem without hard links
        return
    finally:
        temporary.unlink(missing_ok=True)
