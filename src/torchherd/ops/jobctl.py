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
from typing import Any

from ..errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK, ConfigError
from ..job_nodes import (
    RUNNING_STATES,
    StopReport,
    ask_nodes,
    stop_nodes,
)
from ..records import JobRecord, list_records, load_record
from ..transport.agent_call import AgentAnswer


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


# ---------------------------------------------------------------------------------------------
# stop


def stop_job(record: JobRecord, grace: float = 10.0) -> StopReport:
    """Stop every process of the job on every node and confirm none are left."""
    return asyncio.run(stop_nodes(record, grace))


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
