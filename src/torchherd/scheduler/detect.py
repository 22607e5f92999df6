"""Which cluster a command runs on: a Slurm or PBS allocation, else the user's file, else here.

Detection runs in a fixed order, so the answer never depends on which files happen to exist:

    SLURM_JOB_ID                                  -> the Slurm allocation (checked first: a Slurm
                                                     site may also set PBS_JOBID for old scripts)
    PBS_JOBID and a readable PBS_NODEFILE         -> the PBS allocation
    -c FILE / -H HOSTS / ./herd.toml              -> that cluster
    nothing                                       -> this machine alone

Inside an allocation the nodes come from the scheduler; a herd.toml (or -c) still gives the
[cluster] settings (python, env, setup, ...) and per-node settings for nodes it names.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError
from ..hostlist import read_nodefile, slurm_hostnames
from ..spec import ClusterSpec, NodeSpec
from .environment import carried_environment


@dataclass(frozen=True)
class Allocation:
    """The nodes a scheduler gave this job, and where that was read from."""

    scheduler: Literal["slurm", "pbs"]
    job_id: str
    hosts: tuple[str, ...]
    variables: tuple[str, ...]
    """The environment variables the allocation was read from."""
    gpus_per_node: int | None = None
    addrs: Mapping[str, str] = field(default_factory=dict)
    """host -> the address the scheduler reaches it at (Slurm's NodeAddr), where known."""

    @property
    def title(self) -> str:
        name = "Slurm" if self.scheduler == "slurm" else "PBS"
        return f"{name} job {self.job_id}"

    def describe(self) -> str:
        shown = ", ".join(self.hosts[:8]) + (", ..." if len(self.hosts) > 8 else "")
        return (
            f"{self.title} (from {', '.join(self.variables)}): {len(self.hosts)} node(s): {shown}"
        )


def detect_allocation(environ: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation this process runs in, or None (see the module docstring for the order)."""
    environ = os.environ if environ is None else environ
    if environ.get("SLURM_JOB_ID"):
        return slurm_allocation(environ)
    nodefile = environ.get("PBS_NODEFILE", "")
    if environ.get("PBS_JOBID") and nodefile and os.access(nodefile, os.R_OK):
        return pbs_allocation(environ)
    return None


def slurm_allocation(environ: Mapping[str, str]) -> Allocation:
    job_id = environ["SLURM_JOB_ID"]
    tasks = environ.get("SLURM_STEP_NUM_TASKS", "")
    if environ.get("SLURM_STEP_ID") and tasks.isdigit() and int(tasks) > 1:
        # `srun herd launch`: every task would start the whole job again on every node.
        raise ConfigError(
            f"herd runs in a Slurm job step of {tasks} tasks (srun started it {tasks} times)",
            "run herd once, in the batch script or the salloc shell, not under srun: "
            "herd starts one agent per node itself",
        )
    for name in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if environ.get(name):
            nodelist_var, nodelist = name, environ[name]
            break
    else:
        raise ConfigError(
            f"SLURM_JOB_ID={job_id} is set but SLURM_JOB_NODELIST is not",
            "run herd inside the job's batch script or salloc shell, "
            "or unset SLURM_JOB_ID to use herd.toml",
        )
    hosts = tuple(dict.fromkeys(slurm_hostnames(nodelist)))
    variables = ["SLURM_JOB_ID", nodelist_var]
    gpus = _count(environ.get("SLURM_GPUS_ON_NODE"))
    if gpus is not None:
        variables.append("SLURM_GPUS_ON_NODE")
    return Allocation(
        "slurm", job_id, hosts, tuple(variables), gpus, slurm_node_addresses(hosts, environ)
    )


def pbs_allocation(environ: Mapping[str, str]) -> Allocation:
    hosts = tuple(read_nodefile(environ["PBS_NODEFILE"]))
    variables = ["PBS_JOBID", "PBS_NODEFILE"]
    # PBS sets CUDA_VISIBLE_DEVICES for the first node's tasks only; the others have the same
    # chunk (select=N:ngpus=G), so its length is the workers per node.
    gpus = _visible_devices(environ.get("CUDA_VISIBLE_DEVICES"))
    if gpus is not None:
        variables.append("CUDA_VISIBLE_DEVICES")
    return Allocation("pbs", environ["PBS_JOBID"], hosts, tuple(variables), gpus)


def _count(text: str | None) -> int | None:
    return int(text) if text and text.strip().isdigit() and int(text) > 0 else None


def _visible_devices(text: str | None) -> int | None:
    if not text:
        return None
    entries = [e for e in text.split(",") if e.strip() and e.strip() not in ("-1", "NoDevFiles")]
    return len(entries) or None


def slurm_node_addresses(hosts: tuple[str, ...], environ: Mapping[str, str]) -> dict[str, str]:
    """host -> the IP address Slurm reaches it at (``scontrol show node``'s NodeAddr).

    The plan never trusts a node's own idea of its name (it may resolve to 127.0.1.1); Slurm's
    NodeAddr is how the controller itself reaches the node. Names that do not resolve to a
    usable address here are left out (the probe decides then)."""
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    if scontrol is None or not hosts:
        return {}
    try:
        result = subprocess.run(
            [scontrol, "show", "node", "-o", ",".join(hosts)],
            capture_output=True,
            text=True,
            timeout=30,
            env=dict(environ),
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    return {
        host: addr
        for host, name in parse_node_addresses(result.stdout).items()
        if (addr := _usable_address(name)) is not None
    }


def parse_node_addresses(text: str) -> dict[str, str]:
    """``scontrol show node -o`` output -> NodeName -> NodeAddr."""
    found = {}
    for line in text.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if fields.get("NodeName") and fields.get("NodeAddr"):
            found[fields["NodeName"]] = fields["NodeAddr"]
    return found


def _usable_address(name: str) -> str | None:
    try:
        candidates = [str(ipaddress.ip_address(name))]
    except ValueError:
        try:
            infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            return None
        candidates = [str(info[4][0]) for info in infos]
    for candidate in candidates:
        if not ipaddress.ip_address(candidate).is_loopback:
            return candidate
    return None


def cluster_for_allocation(
    allocation: Allocation,
    settings: ClusterSpec | None,
    environ: Mapping[str, str] | None = None,
) -> ClusterSpec:
    """The ClusterSpec of an allocation: its nodes, the [cluster] settings of ``settings``
    (a herd.toml), the launcher's interpreter unless python is configured, and what the
    batch script set up (carry_env)."""
    environ = os.environ if environ is None else environ
    fields: dict[str, Any] = {}
    configured: dict[str, NodeSpec] = {}
    if settings is not None:
        fields = {
            key: getattr(settings, key)
            for key in settings.model_fields_set
            if key not in ("nodes", "transport", "source", "carry_env", "scheduler_job_id")
        }
        for node in settings.nodes:
            configured[node.name] = node
    if "python" not in fields:
        fields["python"] = sys.executable or "python3"
    nodes = []
    for host in allocation.hosts:
        own = configured.get(host) or configured.get(host.split(".", 1)[0])
        node = NodeSpec(
            host=host,
            nproc=own.nproc if own and own.nproc else allocation.gpus_per_node,
            addr=own.addr if own and own.addr else allocation.addrs.get(host),
            iface=own.iface if own else None,
            python=own.python if own else None,
            setup=own.setup if own else None,
        )
        nodes.append(node)
    source = allocation.title
    if settings is not None:
        source += f" with settings from {settings.source}"
    return ClusterSpec(
        nodes=tuple(nodes),
        transport=allocation.scheduler,
        carry_env=carried_environment(environ),
        scheduler_job_id=allocation.job_id,
        source=source,
        **fields,
    )
