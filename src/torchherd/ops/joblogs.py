"""`herd logs JOB`: a job's output, from the launcher's files or from its nodes.

Attached jobs: the launcher kept every line it showed in the job directory (``output.log``,
merged with ``host:rank`` prefixes, and ``rank-R.log``); ``-f`` follows them while the launcher
runs. Detached jobs: each node keeps its events in ``<node_dir>/events.jsonl`` (secret values
already masked); the ``logs`` agent verb sends them, and with ``-f`` keeps sending until the
job ends there. Without ``-f`` the nodes' lines are merged in time order.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from ..agent.protocol import decode
from ..errors import ConfigError, NodeNotReady
from ..job_nodes import RUNNING_STATES, cluster_from_record, job_nodes, verb_request
from ..records import JobRecord, load_record
from ..spec import NodeSpec
from ..transport import Transport, Unreachable, for_cluster
from ..transport.agent_call import agent_argv
from .jobctl import launcher_alive

Write = Callable[[str], None]


def prefix_width(record: JobRecord) -> int:
    hosts = [str(n["host"]) for n in record.nodes] or [""]
    return max(len(h) for h in hosts) + 1 + len(str(max(record.world_size - 1, 0)))


def format_event(host: str, event: dict[str, Any], width: int, rank: int | None) -> str | None:
    """A node event as the launcher would have shown it; None for events that are not lines."""
    if event.get("e") == "line":
        text = str(event.get("t", ""))
        if rank is not None:
            return text
        label = f"{host}:{event['r']}" if event.get("r") is not None else host
        return f"{label.ljust(width)} | {text}"
    if event.get("e") == "error" and rank is None:
        return f"{host.ljust(width)} | herd: {event.get('message', '')}"
    if event.get("e") == "exit" and rank is None:
        how = "stopped" if event.get("stopped") else f"exit code {event.get('code')}"
        return f"{host.ljust(width)} | herd: job ended on {host} ({how})"
    return None


# ---------------------------------------------------------------------------------------------
# attached jobs: the launcher's own files


def attached_logs(record: JobRecord, rank: int | None, follow: bool, write: Write) -> None:
    directory = Path(record.log_dir)
    path = directory / (f"rank-{rank}.log" if rank is not None else "output.log")
    if not path.exists():
        if rank is not None:
            raise ConfigError(
                f"job {record.id} has no lines from rank {rank} in {directory}",
                f"ranks are 0..{record.world_size - 1}; a rank that printed nothing has no file",
            )
        raise ConfigError(f"job {record.id} has no output in {directory}", "`herd ps` lists jobs")
    with open(path, encoding="utf-8", errors="replace") as handle:
        while True:
            chunk = handle.read()
            if chunk:
                write(chunk)
            if not follow or not _attached_running(record.id):
                rest = handle.read()
                if rest:
                    write(rest)
                return
            time.sleep(0.25)


def _attached_running(job_id: str) -> bool:
    record = load_record(job_id)
    return record is not None and record.state in RUNNING_STATES and launcher_alive(record)


# ---------------------------------------------------------------------------------------------
# detached jobs: events on the nodes


def detached_logs(
    record: JobRecord,
    rank: int | None,
    follow: bool,
    write: Write,
    *,
    transport: Transport | None = None,
    kept: bool = False,
) -> None:
    asyncio.run(_detached_logs(record, rank, follow, write, transport, kept))


async def _detached_logs(
    record: JobRecord,
    rank: int | None,
    follow: bool,
    write: Write,
    transport: Transport | None,
    kept: bool = False,
) -> None:
    """Every node's events (a detached job), or with ``kept`` one rank's lines that its node
    kept for a large job instead of sending them to the launcher."""
    cluster = cluster_from_record(record)
    transport = transport or for_cluster(cluster)
    width = prefix_width(record)
    nodes = job_nodes(record, cluster)
    problems: list[str] = []
    collected: list[tuple[float, int, str]] = []

    async def one(node: NodeSpec, unreachable: Unreachable | None) -> None:
        if unreachable is not None:
            problems.append(f"{unreachable.describe()}; fix: {unreachable.remedy}")
            return
        request = verb_request(record, cluster, node) | {"rank": rank, "follow": follow}
        if kept:
            request["kept"] = True
        process = await transport.start(node, agent_argv(cluster, node, "logs"))
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(request).encode() + b"\n")
        if not follow:
            process.stdin.close()
        async for raw in process.stdout:
            event = decode(raw)
            if event is None:
                continue
            if event.get("e") == "error" and "no events file" in str(event.get("message")):
                problems.append(f"{node.host}: {event['message']}")
                continue
            text = format_event(node.host, event, width, rank)
            if text is None:
                continue
            if follow:
                write(text + "\n")
            else:
                collected.append((float(event.get("ts") or 0), len(collected), text))
        if process.stdin is not None and not process.stdin.is_closing():
            process.stdin.close()
        stderr = (await process.stderr.read()).decode(errors="replace") if process.stderr else ""
        if await process.wait() != 0 and kept and not stderr.strip():
            return  # the rank never ran on this node: nothing kept here
        if await process.wait() != 0 and not problems:
            last = stderr.strip().splitlines()[-1:] or [f"exit code {process.returncode}"]
            problems.append(f"{node.host}: cannot read the job's events: {last[0]}")

    try:
        # Bounded waves to connect; then every node's stream at once (a follower may never end).
        links = await transport.each(nodes, transport.connect)
        await asyncio.gather(*(one(n, u) for n, u in zip(nodes, links, strict=True)))
    finally:
        await transport.close()
    for _, _, text in sorted(collected):
        write(text + "\n")
    if kept and not collected and not problems:
        raise ConfigError(
            f"job {record.id}: no node kept lines from rank {rank}",
            f"ranks are 0..{record.world_size - 1}; a rank that printed nothing has no lines",
        )
    if problems:
        raise NodeNotReady(
            "some nodes' output could not be read:\n" + "\n".join(f"  {p}" for p in problems),
            "fix the nodes above and run `herd logs` again",
            hosts=tuple(p.split(":", 1)[0] for p in problems),
        )


def show_logs(record: JobRecord, rank: int | None, follow: bool, stream: TextIO) -> None:
    """Print a job's output (optionally one rank's, optionally following it)."""
    if rank is not None and not 0 <= rank < max(record.world_size, 1):
        raise ConfigError(
            f"job {record.id} has ranks 0..{record.world_size - 1}, not {rank}",
            "give a rank in that range",
        )

    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    if record.detached:
        detached_logs(record, rank, follow, write)
    elif rank is not None and record.lines_on_nodes and not follow:
        # A large job: the launcher's files hold this rank's stderr only; its node has it all.
        detached_logs(record, rank, follow, write, kept=True)
    else:
        attached_logs(record, rank, follow, write)


__all__ = ["show_logs", "format_event"]


# ---------------------------------------------------------------------------------------------
# stacks: the evidence herd kept before stopping the job (recovery.evidence)


def show_stacks(record: JobRecord, rank: int | None, stream: TextIO) -> None:
    """Print every attempt's stacks (or one rank's), with who was found behind."""
    root = Path(record.log_dir) / "stacks"
    attempts = sorted(p for p in root.glob("attempt-*") if p.is_dir()) if root.is_dir() else []
    if not attempts:
        raise ConfigError(
            f"job {record.id} has no stacks",
            "herd takes them only when it stops a job that did not end by itself "
            "(a hang, a lost node, a failure elsewhere, a worker past its grace period)",
        )
    for attempt in attempts:
        stream.write(f"== {attempt.name}\n")
        try:
            summary = json.loads((attempt / "summary.json").read_text())
        except (OSError, ValueError):
            summary = {}
        for reason in sorted(set(summary.get("reasons", {}).values())):
            stream.write(f"taken: {reason}\n")
        for behind in summary.get("behind", []):
            where = f"{behind['host']} rank {behind['rank']}: " if behind.get("host") else ""
            stream.write(f"behind: {where}{behind['why']}\n")
        for path in sorted(attempt.glob("*-rank-*.txt"), key=_rank_of):
            if rank is not None and _rank_of(path) != rank:
                continue
            stream.write(f"\n{path.read_text()}")
        stream.write("\n")
    stream.flush()


def _rank_of(path: Path) -> int:
    """The rank a stacks file belongs to (``<host>-rank-R.txt``, its children's
    ``<host>-rank-R-child-PID.txt`` too)."""
    found = re.search(r"-rank-(\d+)", path.name)
    return int(found.group(1)) if found else -1
