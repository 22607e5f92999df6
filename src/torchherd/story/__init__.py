"""A job's story as one page: `herd report JOB` writes a self-contained HTML file from the job
record (attempts, failures), its per-rank logs and stacks, and the metrics its script wrote.

``gather`` reads what herd kept (tolerating what is missing), ``svg`` draws the timeline and
the curves as inline SVG, ``page`` lays the page out. No plotting library is needed.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import cannot_write
from ..files import write_private
from ..records import JobRecord
from .gather import Story, find_metrics, gather
from .page import render

__all__ = ["Story", "find_metrics", "gather", "render", "write_report"]

PAGE = "report.html"


def write_report(
    record: JobRecord, output: Path | None = None, metrics: str | None = None
) -> tuple[Path, Story]:
    """Write the job's page (default: report.html in its log directory); return its path
    and the story it tells."""
    story = gather(record, metrics)
    page = (output or Path(record.log_dir) / PAGE).expanduser().absolute()
    if page.is_dir() or page.suffix.lower() not in (".html", ".htm"):
        page = page / PAGE  # a directory, existing or to be made
    text = render(story, page)
    try:
        page.parent.mkdir(parents=True, exist_ok=True)
        write_private(page, text)
    except OSError as exc:
        raise cannot_write(page, exc) from None
    return page, story
