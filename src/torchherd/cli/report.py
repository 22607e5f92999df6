"""`herd report [JOB]`: a job's story as one self-contained HTML page."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from ..errors import EXIT_OK
from .app import app
from .jobs import JOB_HELP
from .parsing import HerdCommand


@app.command("report", cls=HerdCommand)
def report_command(
    job: str = typer.Argument(None, help=JOB_HELP, show_default=False),
    output: Path = typer.Option(
        None,
        "-o",
        "--output",
        help="Write the page here (an .html file, or a directory for report.html); default: "
        "report.html in the job's log directory, beside the logs it links to.",
    ),
    metrics: str = typer.Option(
        None,
        "--metrics",
        metavar="PATH",
        help="The job's metrics.jsonl (or the run directory holding it). Default: the "
        "--run-dir among the job's arguments, else a metrics.jsonl written under the job's "
        "working directory while it ran.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print where the page and metrics are."),
    open_page: bool = typer.Option(
        False,
        "--open",
        help="Open the page in a browser once written (the one $BROWSER names, else the "
        "system's default).",
    ),
) -> int:
    """Write one HTML page that tells a job's story, to look at rather than read.

    A timeline of attempts (start, fault, how herd noticed it, stacks taken, restart, world
    size), the step rate per attempt and node, loss and throughput from the metrics the
    script wrote (torchherd.train's metrics.jsonl), the first failure with its cause and fix,
    and links to every rank's log and the stacks. Self-contained (no network, no plotting
    library); open it in any browser.
    """
    from ..ops.jobctl import find_record
    from ..story import write_report

    record = find_record(job)
    page, story = write_report(record, output, metrics)
    found = story.metrics
    if open_page:
        _open_in_browser(page)
    if as_json:
        data = {
            "job": record.id,
            "report": str(page),
            "metrics": str(found.path) if found.path else None,
            "metrics_found_by": found.found_by,
        }
        print(json.dumps(data, indent=2))
        return EXIT_OK
    if job is None:
        print(f"herd: job {record.id} (the latest)", file=sys.stderr)
    print(f"report: {page}")
    print(f"metrics: {found.found_by}", file=sys.stderr)
    return EXIT_OK


def _open_in_browser(page: Path) -> None:
    import webbrowser  # only here: it reads the environment and probes for browsers

    if not webbrowser.open(page.as_uri()):
        print(
            f"herd: no browser could be started here; open {page.as_uri()} in one", file=sys.stderr
        )
