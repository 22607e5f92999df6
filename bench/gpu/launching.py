"""Run `herd` as a user does, with a private HERD_HOME, and read how a job ended from its record.

Verdicts about a launched job come from ``$HERD_HOME/jobs/<id>/job.json`` (state, exit code,
first failure, and the last attempt's outcome, stacks and the ranks found behind), never from
the console's wording, which is written for people and may change. Every run gets its own
HERD_HOME, so the one record there is this run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchherd.bench.job import read_answer

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Run:
    """A finished program: how it exited and what it printed."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False

    def tail(self, lines: int = 12) -> str:
        """The last lines of what it printed, for a failure's detail."""
        text = (self.stdout + "\n" + self.stderr).strip().splitlines()
        return "\n".join(text[-lines:])


@dataclass(frozen=True)
class HerdRun(Run):
    home: Path = Path()
    """The HERD_HOME it ran with."""

    def record(self) -> dict[str, Any] | None:
        """The job record this run left (the newest, should a command launch several)."""
        records = sorted((self.home / "jobs").glob("*/job.json"), key=lambda p: p.stat().st_mtime)
        if not records:
            return None
        return dict(json.loads(records[-1].read_text(encoding="utf-8")))


def _environment(extra: Mapping[str, str] | None) -> dict[str, str]:
    environment = {**os.environ, **(extra or {})}
    # This checkout's torchherd, examples and bench come first, installed or not.
    environment["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "src"), str(REPO), environment.get("PYTHONPATH")) if p
    )
    return environment


def run(
    argv: Sequence[str], *, cwd: Path, timeout: float, env: Mapping[str, str] | None = None
) -> Run:
    """Run ``argv`` to its end (or ``timeout``), output captured."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            list(argv),
            cwd=cwd,
            env=_environment(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        return Run(
            tuple(argv),
            124,
            _text(exc.stdout),
            _text(exc.stderr) + f"\n(no end after {timeout:g} s)",
            time.monotonic() - started,
            timed_out=True,
        )
    return Run(tuple(argv), done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def herd(
    args: Sequence[str],
    *,
    home: Path,
    cwd: Path,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> HerdRun:
    """``herd ARGS`` in ``cwd`` with HERD_HOME=``home``, output captured."""
    home.mkdir(parents=True, exist_ok=True)
    done = run(
        (sys.executable, "-m", "torchherd", *args),
        cwd=cwd,
        timeout=timeout,
        env={**(env or {}), "HERD_HOME": str(home)},
    )
    return HerdRun(**vars(done), home=home)


def python_module(
    module: str, args: Sequence[str], marker: str, *, timeout: float
) -> tuple[Run, dict[str, Any] | None]:
    """``python -m MODULE ARGS`` from the checkout; its run and its ``marker{json}`` answer."""
    done = run((sys.executable, "-m", module, *args), cwd=REPO, timeout=timeout)
    return done, read_answer(done.stdout, marker)


def _text(value: str | bytes | None) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value or ""


@dataclass(frozen=True)
class JobVerdict:
    """How a launched job ended, from its record."""

    state: str
    exit_code: int | None
    outcome: str
    """The last attempt's: succeeded, failed, hung, lost, stopped, saved, interrupted."""
    failure: dict[str, Any] = field(default_factory=dict)
    """host, rank, exitcode, signal, message, cause, remedy (empty when none)."""
    stacks_dir: str | None = None
    behind: tuple[str, ...] = ()
    world_size: int = 0

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded" and self.exit_code == 0

    def describe(self) -> str:
        """One line for a table: how it ended and, for a failure, where and why."""
        if self.succeeded:
            return "succeeded"
        parts = [f"{self.outcome} (exit {self.exit_code})"]
        failure = self.failure
        if failure:
            where = failure.get("host", "")
            if failure.get("rank") is not None:
                where += f" rank {failure['rank']}"
            message = str(failure.get("cause") or failure.get("message") or "").strip()
            parts.append(f"{where}: {message.splitlines()[0] if message else 'no message'}")
        return "; ".join(parts)


def verdict(record: Mapping[str, Any] | None) -> JobVerdict | None:
    """The verdict of a job record (``job.json``); None when there is no record."""
    if record is None:
        return None
    attempts = record.get("attempts") or []
    last = attempts[-1] if attempts else {}
    failure = record.get("first_failure") or last.get("failure") or {}
    return JobVerdict(
        state=str(record.get("state", "")),
        exit_code=record.get("exit_code"),
        outcome=str(last.get("outcome") or record.get("state", "")),
        failure=dict(failure),
        stacks_dir=last.get("stacks_dir"),
        behind=tuple(last.get("behind") or ()),
        world_size=int(last.get("world_size") or record.get("world_size") or 0),
    )


def launch(
    args: Sequence[str],
    *,
    home: Path,
    cwd: Path,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> tuple[HerdRun, JobVerdict | None]:
    """``herd launch ARGS``: the run and its job's verdict (None when no job was recorded)."""
    run = herd(["launch", *args], home=home, cwd=cwd, timeout=timeout, env=env)
    return run, verdict(run.record())
