"""`herd ps`, `herd logs JOB`, `herd stop JOB`: jobs from any terminal, attached or detached."""

from __future__ import annotations

import json
import re
import sys
import time
from typing import Any, TextIO

import typer
from rich.table import Table

from ..errors import EXIT_NODE_NOT_READY, EXIT_OK
from ..records import JobRecord, list_records
from .app import app
from .ops import console
from .parsing import HerdCommand
from .tables import result_table

JOB_HELP = (
    "Job id, its last part (1122-023330-7016 -> 7016) or a prefix of either, or a --name; "
    "default: the latest job. See `herd ps`."
)


def runtime(record: JobRecord, now: float | None = None) -> float:
    end = record.ended if record.ended is not None else (now or time.time())
    return max(0.0, end - record.started)


def clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def ps_row(record: JobRecord) -> dict[str, Any]:
    """One job as `herd ps --json` prints it."""
    return {
        "id": record.id,
        "name": record.name,
        "kind": record.kind,
        "what": record.what,
        "state": record.state,
        "detached": record.detached,
        "nodes": [n["host"] for n in record.nodes],
        "world_size": record.world_size,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.started)),
        "runtime_s": round(runtime(record), 1),
        "exit_code": record.exit_code,
        "first_failure": record.first_failure,
    }


@app.command("ps", cls=HerdCommand)
def ps_command(
    all_jobs: bool = typer.Option(
        False,
        "--all",
        "-a",
        help="Every job, not only the last 20, and herd's own (the doctor's all-reduce, "
        "benchmarks).",
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON list on stdout, for scripts."),
    no_refresh: bool = typer.Option(
        False, "--no-refresh", help="Do not ask the nodes of running detached jobs how they are."
    ),
) -> int:
    """List jobs: id, name, state, nodes, world size, started, runtime, exit code and what ran;
    and jobs sent to Slurm/PBS by `herd submit`, with the scheduler's state (squeue/sacct,
    qstat).

    Running detached jobs are checked on their nodes (one ssh per node), so a job that ended
    while nobody watched shows how it ended.
    """
    from ..ops.jobctl import refresh
    from ..scheduler.submit import list_submitted, scheduler_states

    records = list_records()
    if not all_jobs:
        records = [r for r in records if r.kind == "job"][-20:]
    if not no_refresh:
        records = refresh(records)
    submitted = list_submitted()[-20:] if not all_jobs else list_submitted()
    states = scheduler_states(submitted) if submitted else {}
    if as_json:
        rows = [ps_row(r) for r in records] + [
            {
                "id": job.job_id,
                "scheduler": job.scheduler,
                "name": job.name,
                "state": states[job.job_id],
                "submitted": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(job.submitted)),
            }
            for job in submitted
        ]
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    if submitted:
        table = result_table(("SUBMITTED JOB", "SCHEDULER", "NAME", "STATE", "SUBMITTED"))
        for job in submitted:
            table.add_row(
                job.job_id,
                job.scheduler,
                job.name,
                states[job.job_id],
                time.strftime("%m-%d %H:%M:%S", time.localtime(job.submitted)),
            )
        console().print(table)
        if records:
            print()
    if not records:
        if not submitted:
            print("no jobs yet: start one with `herd launch train.py` (or `herd demo`)")
        return EXIT_OK
    header = ("ID", "NAME", "STATE", "NODES", "WORLD", "STARTED", "RUNTIME", "EXIT", "COMMAND")
    lines: list[tuple[str, ...]] = []
    for record in records:
        hosts = [str(n["host"]) for n in record.nodes]
        shown = ",".join(hosts) if len(hosts) <= 3 else f"{hosts[0]},…({len(hosts)})"
        state = record.state + (" (detached)" if record.detached else "")
        name = record.name or ("" if record.kind == "job" else f"({record.kind})")
        lines.append(
            (
                record.id,
                name or "-",
                state,
                shown,
                str(record.world_size),
                time.strftime("%m-%d %H:%M", time.localtime(record.started)),
                clock(runtime(record)),
                "-" if record.exit_code is None else str(record.exit_code),
                record.what or "-",
            )
        )
    out = console()
    out.print(ps_table(header, lines, out.width))
    return EXIT_OK


# Left out first when a terminal is too narrow for one line per job.
NARROW_LEAVES_OUT = ("NODES", "WORLD", "STARTED")


def ps_table(header: tuple[str, ...], lines: list[tuple[str, ...]], width: int) -> Table:
    """One line per job: every column as wide as its text and the command cut to what is
    left; on a narrow terminal without nodes, world size and start time."""

    def widths(columns: tuple[str, ...]) -> list[int]:
        keep = [header.index(c) for c in columns]
        return [max(len(line[i]) for line in (header, *lines)) for i in keep]

    columns = header
    if sum(widths(header)[:-1]) + 2 * (len(header) - 1) + 12 > width:
        columns = tuple(c for c in header if c not in NARROW_LEAVES_OUT)
    table = result_table(columns, right=("WORLD", "EXIT"))
    for column in table.columns:
        column.no_wrap = True
    room = width - sum(widths(columns)[:-1]) - 2 * (len(columns) - 1)
    table.columns[-1].overflow = "ellipsis"
    table.columns[-1].max_width = max(12, room)
    for line in lines:
        table.add_row(*(line[header.index(c)] for c in columns))
    return table


@app.command("logs", cls=HerdCommand)
def logs_command(
    job: str = typer.Argument(None, help=JOB_HELP, show_default=False),
    rank: int = typer.Option(None, "--rank", "-r", help="Only this global rank's lines."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
    stacks: bool = typer.Option(
        False,
        "--stacks",
        help="Print the workers' stacks herd took before it stopped the job (a hang, a lost "
        "node, a failure), and which ranks it found behind.",
    ),
    as_json: bool = typer.Option(
        False,
        "--json",
        help='One JSON object a line: {"host", "rank", "text"} (host and rank null for '
        "herd's own lines).",
    ),
) -> int:
    """Print a job's output (the latest job's without JOB): every rank with host:rank
    prefixes, or one rank's lines.

    Attached jobs are read from the launcher's job directory; detached jobs from their nodes.
    """
    from ..ops.jobctl import find_record
    from ..ops.joblogs import show_logs, show_stacks

    record = find_record(job)
    if job is None:
        print(f"herd: job {record.id} (the latest)", file=sys.stderr, flush=True)
    if stacks:
        show_stacks(record, rank, sys.stdout)
        return EXIT_OK
    if as_json:
        lines = JsonLines(sys.stdout, rank)
        show_logs(record, rank, follow, lines)  # type: ignore[arg-type]
        lines.close()
        return EXIT_OK
    show_logs(record, rank, follow, sys.stdout)
    return EXIT_OK


class JsonLines:
    """A stream for `herd logs --json`: each line it is given ("node2:1 | text", a rank's own
    file's "text", herd's "herd: ...") written as one JSON object."""

    LABEL = re.compile(r"^(?P<host>[^\s|:]+)(?::(?P<rank>\d+))?\s* \| (?P<text>.*)$")

    def __init__(self, out: TextIO, rank: int | None) -> None:
        self.out, self.rank, self.pending = out, rank, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.out.write(json.dumps(self.parse(line)) + "\n")
        return len(text)

    def parse(self, line: str) -> dict[str, Any]:
        if self.rank is not None:  # one rank's own file: its lines as printed
            return {"host": None, "rank": self.rank, "text": line}
        found = self.LABEL.match(line)
        if found is None:
            return {"host": None, "rank": None, "text": line}
        rank = found["rank"]
        return {"host": found["host"], "rank": int(rank) if rank else None, "text": found["text"]}

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        if self.pending:
            self.write("\n")
        self.flush()


@app.command("stop", cls=HerdCommand)
def stop_command(
    job: str = typer.Argument(
        None,
        help=JOB_HELP.replace("the latest job", "the one running job"),
        show_default=False,
    ),
    grace: float = typer.Option(
        10.0, "--grace", min=0, help="Seconds the workers get after SIGTERM before SIGKILL."
    ),
) -> int:
    """Stop exactly this job's processes on every node, and confirm none are left.

    Processes are found by the job id every one of them carries, never by name, so other
    jobs on the same nodes are untouched. Works for attached jobs too (their launcher then
    reports the job as stopped). Without JOB: the job that is running, if there is just one.
    """
    from ..ops.jobctl import RUNNING_STATES, find_record, stop_job

    record = find_record(job, running=job is None)
    hosts = [str(n["host"]) for n in record.nodes]
    print(f"herd: stopping job {record.id} on {len(hosts)} node(s)", flush=True)
    report = stop_job(record, grace)
    width = max(len(h) for h in hosts)
    for node in report.nodes:
        if node.error is not None:
            line = f"FAILED: {node.error}"
        elif node.survivors:
            pids = " ".join(str(p) for p in node.survivors)
            line = f"FAILED: {len(node.survivors)} process(es) still there (pids {pids})"
        else:
            line = f"ended {node.processes} process(es), none left"
        print(f"  {node.host.ljust(width)}  {line}")
    if report.ok and report.previous_state not in RUNNING_STATES:
        print(
            f"job {record.id} had already ended ({report.previous_state}); "
            "nothing of it is left on its nodes"
        )
        return EXIT_OK
    if report.ok:
        print(f"job {record.id} stopped on every node")
        return EXIT_OK
    print(
        f"job {record.id}: not confirmed stopped everywhere; run `herd stop {record.id}` again "
        "once the nodes above answer",
        file=sys.stderr,
    )
    return EXIT_NODE_NOT_READY
