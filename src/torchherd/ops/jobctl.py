"""Job control from any terminal: `herd stop`, the states `herd ps` shows, reaching a job's nodes.

A job record (``~/.herd/jobs/<id>/job.json``) keeps the cluster as it was launched, so these
commands reach the job's nodes from any directory. Nodes are asked through agent verbs:
``stop`` ends the job's processes (found by job id, never by name) and reports survivors;
``status`` says whether a detached job still runs and how it ended.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK, ConfigError
from ..jobs import JobRecord, list_records, load_record
from ..plan import LaunchPlan
from ..redact import MASK, redact_argv, redact_env, redact_text
from ..spec import ClusterSpec, NodeSpec, load_cluster_file
from ..transport import Transport, for_cluster
from .remote import AgentAnswer, call_agent

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


def find_record(job_id: str | None, *, running: bool = False) -> JobRecord:
    """The record a user means by ``job_id``: the whole id, its last part (the random
    ``7016`` of ``1122-023330-7016``) or a prefix of either, or a ``--name`` (its latest job).
    None: the latest of the user's jobs (with ``running``, the one that still runs).
    ConfigError names the choices when that is not exactly one job."""
    if job_id is None:
        return latest_record(running=running)
    # Only a plain name is looked up as a directory: never a path (`..`, `a/b`).
    plain = re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z._-]*", job_id) is not None
    record = load_record(job_id) if plain else None
    if record is not None:
        return record
    records = list_records()
    named = [r for r in records if r.name == job_id]
    if named:
        return named[-1]
    matches = [r for r in records if r.id.startswith(job_id) or _tail(r.id).startswith(job_id)]
    if len(matches) == 1:
        return matches[0]
    # The user's jobs only, as `herd ps` lists them: herd's own measuring jobs would mislead.
    recent = ", ".join(r.id for r in [r for r in records if r.kind == "job"][-5:]) or "none yet"
    if matches:
        raise ConfigError(
            f"job id {job_id!r} is ambiguous: {', '.join(r.id for r in matches)}",
            "give more of the id",
        )
    raise ConfigError(f"no job {job_id!r}", f"`herd ps` lists jobs (most recent: {recent})")


def _tail(job_id: str) -> str:
    return job_id.rsplit("-", 1)[-1]


def latest_record(*, running: bool = False) -> JobRecord:
    """The user's latest job (herd's own measuring jobs left out); with ``running``, the
    one job still running, refusing to guess between several."""
    records = [r for r in list_records() if r.kind == "job"]
    if running:
        live = [r for r in refresh(records) if r.state in RUNNING_STATES]
        if len(live) > 1:
            raise ConfigError(
                f"{len(live)} jobs are running: {', '.join(r.id for r in live)}",
                "name the one you mean (its id, the last part of it, or its --name)",
            )
        records = live
    if not records:
        what = "running job" if running else "job"
        raise ConfigError(f"no {what} to pick", "`herd ps --all` lists every job")
    return records[-1]


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


# ---------------------------------------------------------------------------------------------
# stop


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


def stop_job(record: JobRecord, grace: float = 10.0) -> StopReport:
    """Stop every process of the job on every node and confirm none are left."""
    return asyncio.run(stop_nodes(record, grace))


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


# ---------------------------------------------------------------------------------------------
# ps


def launcher_alive(record: JobRecord) -> bool:
    try:
        os.kill(record.launcher_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def refresh(records: list[JobRecord]) -> list[JobRecord]:
    """Bring running records up to date: ask the nodes of detached jobs how they are doing.

    An attached job whose launcher is gone shows as "lost" (its agents stopped the job when
    their link closed); that is not saved, since only the launcher knows how it ended.
    """
    detached = [r for r in records if r.detached and r.state in RUNNING_STATES]
    if detached:
        asyncio.run(_refresh_detached(detached))
    for record in records:
        if not record.detached and record.state in RUNNING_STATES and not launcher_alive(record):
            record.state = "lost"
    return records


async def _refresh_detached(records: list[JobRecord]) -> None:
    async def one(record: JobRecord) -> None:
        try:
            answers = await ask_nodes(record, "status", timeout=30)
        except ConfigError:
            return
        apply_status(record, answers)

    await asyncio.gather(*(one(r) for r in records))


def apply_status(record: JobRecord, answers: list[AgentAnswer]) -> None:
    """Update a detached job's record from its nodes' status answers (saved when it ended)."""
    if not answers or any(not a.ok for a in answers):
        return  # a node we cannot see may still run the job
    data = [a.data or {} for a in answers]
    if any(d.get("agent") or d.get("processes") for d in data):
        return
    exits = [d.get("exit") or {} for d in data]
    errors = [d.get("error") for d in data if d.get("error")]
    if all(e.get("code") == 0 for e in exits):
        record.state, record.exit_code = "succeeded", EXIT_OK
    elif any(e.get("stopped") for e in exits):
        record.state, record.exit_code = "stopped", EXIT_INTERRUPTED
    else:
        record.state, record.exit_code = "failed", EXIT_JOB_FAILED
        record.first_failure = _first_failure(answers, errors)
    times = [float(e["ts"]) for e in exits if e.get("ts")]
    record.ended = max(times) if times else time.time()
    record.save()


def _first_failure(answers: list[AgentAnswer], errors: list[Any]) -> dict[str, Any] | None:
    candidates = []
    for answer in answers:
        exit_event = (answer.data or {}).get("exit") or {}
        for failure in exit_event.get("failures", []):
            candidates.append(
                (
                    failure.get("signal") is not None,
                    failure.get("timestamp") or 0,
                    answer.host,
                    failure,
                )
            )
    if candidates:
        candidates.sort(key=lambda c: (c[0], c[1]))
        _, _, host, failure = candidates[0]
        return {
            "host": host,
            "rank": failure.get("rank"),
            "exitcode": failure.get("exitcode"),
            "signal": failure.get("signal"),
            "message": (str(failure.get("message", "")).strip().splitlines() or [""])[0],
        }
    if errors:
        return {
            "host": "",
            "rank": None,
            "exitcode": None,
            "signal": None,
            "message": str(errors[0].get("message", "")),
        }
    return None
