"""A recorded job's nodes: its record as the launch writes it, its cluster rebuilt from that
record, and agent verbs asked of its nodes (stop first of all).

The launcher (which writes the record and, for `--detach`, may have to stop the nodes it
started) and the job-control commands in ``ops/`` (`herd stop`, `ps`, `logs`, from any terminal)
both need these; they live here, below both, so neither side reaches into the other.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import EXIT_INTERRUPTED, ConfigError
from .plan import LaunchPlan
from .records import JobRecord, load_record
from .redact import MASK, redact_argv, redact_env, redact_text
from .spec import ClusterSpec, NodeSpec, load_cluster_file
from .transport import Transport, for_cluster
from .transport.agent_call import AgentAnswer, call_agent

RUNNING_STATES = ("starting", "running")


def cluster_snapshot(cluster: ClusterSpec, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """The cluster for a job record: env masked (by name and by value), paths made absolute."""
    data = cluster.model_dump(mode="json")
    data["env"] = redact_env(cluster.env, secrets)
    for key in ("ssh_config", "env_file"):
        if data.get(key):
            data[key] = os.path.abspath(os.path.expanduser(data[key]))
    return data


def cluster_file_of(cluster: ClusterSpec) -> str | None:
    """The absolute path of the file a cluster came from, when it came from one."""
    return os.path.abspath(cluster.source) if os.path.isfile(cluster.source) else None


def new_record(
    cluster: ClusterSpec, plan: LaunchPlan, log_dir: Path, *, state: str, detached: bool = False
) -> JobRecord:
    """The record of a job about to start: what ps, logs and stop need, secrets masked."""
    secrets = list(plan.secret_env.values())
    return JobRecord(
        id=plan.job_id,
        state=state,
        started=time.time(),
        source=cluster.source,
        nodes=[{"host": n.host, "nproc": n.nproc} for n in plan.nodes],
        world_size=plan.world_size,
        command=redact_argv(plan.nodes[0].argv, secrets),
        rdzv_endpoint=plan.rdzv_endpoint,
        # Absolute: `herd logs` reads it from whatever directory it is run in.
        log_dir=str(Path(log_dir).expanduser().absolute()),
        # So `herd stop JOB` from another terminal and directory can reach the nodes.
        cluster=cluster_snapshot(cluster, secrets),
        cluster_file=cluster_file_of(cluster),
        detached=detached,
        name=plan.name,
        what=redact_text(plan.what, secrets),
        kind=plan.kind,
    )


def cluster_from_record(record: JobRecord) -> ClusterSpec:
    """The cluster a job was launched on, rebuilt from its record."""
    if record.cluster:
        data = dict(record.cluster)
        # Masked values are useless to the nodes; the verbs need only HERD_HOME from env.
        data["env"] = {k: v for k, v in dict(data.get("env") or {}).items() if v != MASK}
        return ClusterSpec.model_validate(data)
    if record.cluster_file and Path(record.cluster_file).is_file():
        return load_cluster_file(record.cluster_file)
    raise ConfigError(
        f"job {record.id} does not record its cluster (it was started by an older herd)",
        "stop it on each node with `herd exec -- pkill -f <its script>` only if nothing else "
        "runs there, or wait for it to end",
    )


def verb_request(record: JobRecord, cluster: ClusterSpec, node: NodeSpec) -> dict[str, Any]:
    """What every job verb needs to find the job on a node."""
    request: dict[str, Any] = {"job_id": record.id, "node": node.name}
    if record.node_dirs.get(node.host):
        request["node_dir"] = record.node_dirs[node.host]
    if cluster.env.get("HERD_HOME"):
        request["herd_home"] = cluster.env["HERD_HOME"]
    return request


def job_nodes(record: JobRecord, cluster: ClusterSpec) -> list[NodeSpec]:
    """The nodes of the job (in launch order), as NodeSpecs of its cluster."""
    hosts = [str(n["host"]) for n in record.nodes]
    by_host = {n.host: n for n in cluster.nodes}
    return [by_host.get(h) or NodeSpec(host=h) for h in hosts]


async def ask_nodes(
    record: JobRecord,
    verb: str,
    extra: dict[str, Any] | None = None,
    *,
    timeout: float = 60,
    transport: Transport | None = None,
) -> list[AgentAnswer]:
    """Run an agent verb for this job on each of its nodes, in parallel."""
    cluster = cluster_from_record(record) if transport is None else transport.cluster
    own = transport is None
    transport = transport or for_cluster(cluster)
    nodes = job_nodes(record, cluster)

    async def ask(node: NodeSpec) -> AgentAnswer:
        unreachable = await transport.connect(node)
        if unreachable is not None:
            return AgentAnswer(
                node.host, None, f"{unreachable.describe()}; fix: {unreachable.remedy}"
            )
        request = verb_request(record, cluster, node) | (extra or {})
        return await call_agent(transport, node, verb, request, timeout=timeout)

    try:
        return await transport.each(nodes, ask)
    finally:
        if own:
            await transport.close()


@dataclass(frozen=True)
class NodeStop:
    host: str
    processes: int = 0
    """Processes of the job found on the node when the stop began."""
    survivors: tuple[int, ...] = ()
    """Pids still there after SIGKILL (should never happen; reported if it does)."""
    error: str | None = None

    @property
    def confirmed(self) -> bool:
        return self.error is None and not self.survivors


@dataclass
class StopReport:
    job_id: str
    nodes: list[NodeStop] = field(default_factory=list)
    previous_state: str = ""

    @property
    def ok(self) -> bool:
        return all(n.confirmed for n in self.nodes)


async def stop_nodes(
    record: JobRecord, grace: float = 10.0, transport: Transport | None = None
) -> StopReport:
    """`stop_job` inside a running event loop, optionally over a borrowed transport."""
    extra = {"grace": grace}
    answers = await ask_nodes(record, "stop", extra, timeout=grace + 60, transport=transport)
    report = StopReport(record.id, previous_state=record.state)
    for answer in answers:
        if not answer.ok or answer.data is None:
            report.nodes.append(NodeStop(answer.host, error=answer.error))
            continue
        survivors = tuple(int(p) for p in answer.data.get("survivors", ()))
        error = None
        if answer.data.get("agent_left"):
            error = f"{answer.host}: the job's agent (pid {answer.data.get('agent')}) did not exit"
        report.nodes.append(
            NodeStop(answer.host, int(answer.data.get("processes", 0)), survivors, error)
        )
    fresh = load_record(record.id) or record
    if report.ok and fresh.state in RUNNING_STATES:
        fresh.state = "stopped"
        fresh.ended = time.time()
        fresh.exit_code = EXIT_INTERRUPTED
        fresh.save()
    return report
