"""Shared by the FAKE PBS commands in this folder: where the fake keeps its state, recording."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def state_dir() -> Path:
    path = Path(os.environ.get("FAKE_PBS_DIR", ""))
    if not path.is_dir():
        sys.stderr.write("FAKE PBS: FAKE_PBS_DIR is not set to a folder\n")
        raise SystemExit(2)
    return path


def record(command: str, argv: list[str], **extra: object) -> None:
    with open(state_dir() / "calls.jsonl", "a") as calls:
        calls.write(json.dumps({"command": command, "argv": argv, **extra}) + "\n")


def jobs() -> dict[str, dict[str, object]]:
    path = state_dir() / "jobs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def save_jobs(data: dict[str, dict[str, object]]) -> None:
    (state_dir() / "jobs.json").write_text(json.dumps(data))
