"""The GPU check's results: one row per thing checked, the JSON report and the table.

A row is one of:
  - ``passed`` / ``failed``: a check that either works or does not (a test, a correct sum);
  - ``measured``: a number, with a target when there is one (``met`` says whether it was met);
  - ``not run``: with why (one GPU: no NCCL between GPUs; no Triton: no torch.compile; ...).
Nothing that did not run is ever shown as passed. A part that broke (a job that failed, a
program that printed no result) is ``failed``, with what it said.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.table import Table

SCHEMA = "torchherd-gpu-check/1"
Status = Literal["passed", "failed", "measured", "not run"]
_COMPARE = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


@dataclass(frozen=True)
class Target:
    """``value <op> bound``: a number's target, as the issue or a benchmark states it."""

    op: str
    bound: float

    def met(self, value: float) -> bool:
        return bool(_COMPARE[self.op](value, self.bound))

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


@dataclass(frozen=True)
class Row:
    part: str
    """Which part of the check: tests, gpt, snapshot, allreduce, machine."""
    name: str
    """What was checked or measured, in words."""
    status: Status
    detail: str = ""
    """The figures, the reason it did not run, or what failed."""
    value: float | None = None
    target: Target | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def met(self) -> bool | None:
        if self.status != "measured" or self.target is None or self.value is None:
            return None
        return self.target.met(self.value)

    @property
    def verdict(self) -> str:
        if self.status == "measured":
            met = self.met
            return "measured" if met is None else ("met" if met else "NOT MET")
        if self.status == "failed":
            return "FAILED"
        return self.status

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["target"] = str(self.target) if self.target else None
        out["met"] = self.met
        out["verdict"] = self.verdict
        return out


def passed(part: str, name: str, detail: str = "", **data: Any) -> Row:
    return Row(part, name, "passed", detail, data=data)


def failed(part: str, name: str, detail: str, **data: Any) -> Row:
    return Row(part, name, "failed", detail, data=data)


def not_run(part: str, name: str, why: str, **data: Any) -> Row:
    return Row(part, name, "not run", why, data=data)


def measured(
    part: str,
    name: str,
    value: float,
    detail: str,
    target: Target | None = None,
    **data: Any,
) -> Row:
    return Row(part, name, "measured", detail, value=value, target=target, data=data)


@dataclass
class Report:
    machine: dict[str, Any]
    """GPUs (nvidia-smi), driver, CUDA, torch and its features, python, host."""
    rows: list[Row] = field(default_factory=list)
    started: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def add(self, rows: Iterable[Row]) -> None:
        self.rows.extend(rows)

    def counts(self) -> dict[str, int]:
        verdicts = [row.verdict for row in self.rows]
        return {
            "passed": verdicts.count("passed"),
            "failed": verdicts.count("FAILED"),
            "not_run": verdicts.count("not run"),
            "met": verdicts.count("met"),
            "not_met": verdicts.count("NOT MET"),
            "measured": verdicts.count("measured"),
        }

    @property
    def exit_code(self) -> int:
        """1 when anything failed; a target not met is a finding, shown but not a failure."""
        return 1 if any(row.status == "failed" for row in self.rows) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "started": self.started,
            "seconds": round(self.seconds, 1),
            "machine": self.machine,
            "rows": [row.to_dict() for row in self.rows],
            "counts": self.counts(),
            "notes": self.notes,
            "exit_code": self.exit_code,
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


_STYLE = {"passed": "green", "met": "green", "FAILED": "bold red", "NOT MET": "bold red"}


def render(report: Report, console: Console) -> None:
    """The table: part, what, result, target, verdict; then the counts."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("part", "check", "result", "target", "verdict"):
        table.add_column(column, overflow="fold")
    for row in report.rows:
        style = _STYLE.get(row.verdict, "dim" if row.status == "not run" else "")
        verdict = f"[{style}]{escape(row.verdict)}[/]" if style else escape(row.verdict)
        table.add_row(
            escape(row.part),
            escape(row.name),
            escape(row.detail),
            escape(str(row.target or "")),
            verdict,
        )
    console.print(table)
    counts = report.counts()
    console.print(
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['not_run']} not run; "
        f"targets: {counts['met']} met, {counts['not_met']} not met; "
        f"{report.seconds:.0f} s"
    )
    for note in report.notes:
        console.print(f"note: {escape(note)}")
