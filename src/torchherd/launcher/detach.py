"""`herd launch --detach`: start the job on every node and return once every node has started.

Each node agent gets the usual job request plus ``"detach": true`` on stdin, daemonizes, and
answers with one "started" (or "error") event; then its ssh session ends. The job keeps running
with nobody attached: `herd logs JOB -f` re-attaches, `herd ps` shows it, `herd stop JOB` ends
it. If any node cannot start, the nodes that did are stopped again: a job needs every node.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from ..agent.protocol import decode
from ..errors import EXIT_NODE_NOT_READY, EXIT_OK
from ..job_nodes import new_record, stop_nodes
from ..logs import JobOutput
from ..plan import LaunchPlan, NodePlan
from ..records import JobRecord, job_dir
from ..redact import redact_text
from ..results import Failure, RunResult
from ..spec import ClusterSpec, NodeSpec
from ..transport import Transport
from ..transport.agent_call import agent_argv
from .attempt import agent_request

# Seconds a node gets to say "started" (the agent waits up to 120 s for its daemon).
START_TIMEOUT = 150.0
# Marks a failed start after which the job may be running on the node all the same.
MAYBE_STARTED = "maybe_started"


def may_have_started(events: dict[str, dict[str, Any]]) -> list[str]:
    """Nodes a failed start must stop: those that said "started", and those whose answer
    never came (a timeout, a broken link). Only a node that was not reached, or whose agent
    said why it would not start, surely runs nothing."""
    return [h for h, e in events.items() if e.get("e") == "started" or e.get(MAYBE_STARTED)]


def detach_request(plan: LaunchPlan, node: NodePlan) -> dict[str, Any]:
    """An attempt's request with ``detach`` set (and no heartbeat or silence limit: nobody
    will ping)."""
    request = agent_request(plan, node) | {"detach": True}
    request.pop("heartbeat", None)
    request.pop("silence", None)
    request.pop("serve", None)
    return request


async def start_node(
    transport: Transport, node: NodeSpec, request: dict[str, Any]
) -> dict[str, Any]:
    """Start one detached agent; its first event ("started" or "error")."""
    try:
        process = await transport.start(node, agent_argv(transport.cluster, node, "run"))
    except OSError as exc:  # the local transport runs the interpreter itself
        return {
            "e": "error",
            "message": f"cannot start the agent on {node.host}: {exc}",
            "remedy": "check python for this node in herd.toml",
        }
    assert process.stdin is not None and process.stdout is not None
    try:
        process.stdin.write(json.dumps(request).encode() + b"\n")
        await process.stdin.drain()
        process.stdin.close()
        out, err = await asyncio.wait_for(process.communicate(), START_TIMEOUT)
    except TimeoutError:
        process.kill()
        await process.wait()
        return {
            "e": "error",
            "message": f"{node.host} did not start the job in {START_TIMEOUT:g} s",
            "remedy": "check the node's load and disk",
            # Its agent may have daemonized and started the job after all.
            MAYBE_STARTED: True,
        }
    except (ConnectionError, OSError) as exc:
        out, err = b"", str(exc).encode()
        await process.wait()
    events = [e for e in (decode(line) for line in out.splitlines()) if e is not None]
    for event in events:
        if event.get("e") in ("started", "error"):
            return event
    stderr = err.decode(errors="replace")
    unreachable = transport.classify_failure(node, process.returncode or 0, stderr)
    if unreachable is not None:
        return {"e": "error", "message": unreachable.describe(), "remedy": unreachable.remedy}
    if "No module named torchherd" in stderr:
        return {
            "e": "error",
            "message": f"torchherd is not installed on {node.host}",
            "remedy": "`herd exec -- python3 -m pip install torchherd`",
        }
    last = stderr.strip().splitlines()[-1:] or [f"exit code {process.returncode}"]
    return {
        "e": "error",
        "message": f"{node.host}: the agent did not start: {last[0]}",
        "remedy": "update torchherd on that node to this version (`herd doctor` compares)",
        # No answer from the agent (the link broke, it crashed): it may have started the job.
        MAYBE_STARTED: True,
    }


async def start_detached(
    cluster: ClusterSpec,
    plan: LaunchPlan,
    transport: Transport,
    stream: TextIO,
    *,
    log_dir: Path | None = None,
    banner: str = "",
) -> RunResult:
    """Start every node detached; record the job; return at once (exit 0) or say why not."""
    secrets = list(plan.secret_env.values())
    record = new_record(
        cluster, plan, log_dir or job_dir(plan.job_id), state="starting", detached=True
    )
    record.save()
    if banner:
        stream.write(banner + "\n")
    plans = {p.host: p for p in plan.nodes}
    nodes = [n for n in cluster.nodes if n.host in plans]
    output = JobOutput(
        Path(record.log_dir), list(plans), plan.world_size, stream=io.StringIO(), secrets=secrets
    )
    output.note(banner)  # the launcher's side of the job directory says what was started
    output.close()

    async def start(node: NodeSpec) -> dict[str, Any]:
        # Never raise: the other nodes' starts would be cancelled half-way, and a subprocess
        # cancelled while it is being created can hang asyncio's shutdown.
        try:
            return await start_node(transport, node, detach_request(plan, plans[node.host]))
        except Exception as exc:
            return {"e": "error", "message": f"{node.host}: {type(exc).__name__}: {exc}"}

    events = dict(zip([n.host for n in nodes], await transport.each(nodes, start), strict=True))
    started = {h: e for h, e in events.items() if e.get("e") == "started"}
    record.node_dirs = {h: str(e.get("node_dir", "")) for h, e in started.items()}
    if len(started) == len(events):
        record.state = "running"
        record.save()
        stream.write(
            f"herd: job {plan.job_id} is running detached on {len(started)} node(s), "
            f"world size {plan.world_size}\n"
            f"  follow its output: herd logs {plan.job_id} -f\n"
            f"  see how it does:   herd ps\n"
            f"  stop it:           herd stop {plan.job_id}\n"
        )
        stream.flush()
        return RunResult(
            plan.job_id, EXIT_OK, {h: "running" for h in events}, log_dir=Path(record.log_dir)
        )
    return await _not_started(record, events, stream, secrets, transport, plan.grace)


async def _not_started(
    record: JobRecord,
    events: dict[str, dict[str, Any]],
    stream: TextIO,
    secrets: list[str],
    transport: Transport,
    grace: float,
) -> RunResult:
    failed = {h: e for h, e in events.items() if e.get("e") != "started"}
    started = may_have_started(events)
    for host, event in failed.items():
        message = redact_text(str(event.get("message")), secrets)
        stream.write(f"herd: {host} did not start: {message}\n")
        if event.get("remedy"):
            stream.write(f"  fix: {event['remedy']}\n")
    if started:
        stream.write(f"herd: stopping the job on {', '.join(started)} (it needs every node)\n")
        record.state = "running"
        record.save()
        await stop_nodes(_only(record, started), grace, transport)
    record.state = "failed"
    record.ended = time.time()
    record.exit_code = EXIT_NODE_NOT_READY
    host, event = next(iter(failed.items()))
    message = redact_text(str(event.get("message", "")), secrets)
    record.first_failure = {
        "host": host,
        "rank": None,
        "exitcode": None,
        "signal": None,
        "message": message,
    }
    record.save()
    stream.flush()
    status = {h: ("stopped" if h in started else "not started") for h in events}
    failure = Failure(
        host=host,
        rank=None,
        exitcode=None,
        signal=None,
        message=message,
        remedy=str(event.get("remedy", "")),
    )
    return RunResult(record.id, EXIT_NODE_NOT_READY, status, failure, log_dir=Path(record.log_dir))


def _only(record: JobRecord, hosts: list[str]) -> JobRecord:
    return replace(record, nodes=[n for n in record.nodes if n["host"] in hosts])
