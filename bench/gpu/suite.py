"""Part 1 of the GPU check: run tests/gpu with pytest and turn its JUnit XML into rows.

Each test is one row: passed, failed (with pytest's message), or not run with the reason it
skipped for ("needs 2 GPUs", ...). A test marked as a known gap (xfail) shows as not run with
its reason, so the table never calls it passed; one that passes unexpectedly fails (strict).
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path

from .launching import REPO
from .report import Row, failed, not_run, passed

PART = "tests/gpu"


def parse_junit(text: str) -> list[Row]:
    """Rows from pytest's ``--junit-xml`` file, in the order the tests ran."""
    root = ElementTree.fromstring(text)
    rows = []
    for case in root.iter("testcase"):
        name = _test_name(case.get("classname", ""), case.get("name", ""))
        seconds = float(case.get("time") or 0)
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            rows.append(failed(PART, name, _message(problem), seconds=seconds))
        elif skipped is not None:
            why = _message(skipped)
            if skipped.get("type") == "pytest.xfail":
                why = f"known gap (xfail): {why}"
            rows.append(not_run(PART, name, why, seconds=seconds))
        else:
            rows.append(passed(PART, name, f"{seconds:.1f} s", seconds=seconds))
    return rows


def _test_name(classname: str, name: str) -> str:
    """``tests.gpu.test_nccl`` + ``test_x[2]`` -> ``test_nccl::test_x[2]``."""
    module = classname.rsplit(".", 1)[-1] if classname else ""
    return f"{module}::{name}" if module else name


def _message(element: ElementTree.Element) -> str:
    message = (element.get("message") or element.text or "").strip()
    for prefix in ("Skipped: ", "XFAIL "):
        message = message.removeprefix(prefix)
    first = message.splitlines()[0] if message else "no message"
    return first[:300]


Runner = Callable[[list[str], float], subprocess.CompletedProcess[str]]


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def run_suite(out_dir: Path, timeout: float = 420.0, run: Runner = _run) -> list[Row]:
    """pytest tests/gpu; one row per test, or one failed row when pytest itself broke."""
    junit = out_dir / "tests-gpu.xml"
    argv = [
        sys.executable,
        "-m",
        "pytest",
        str(REPO / "tests" / "gpu"),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junit-xml={junit}",
        "-o",
        "junit_family=xunit1",
    ]
    try:
        done = run(argv, timeout)
    except subprocess.TimeoutExpired:
        rows = parse_junit(junit.read_text()) if junit.exists() else []
        return [*rows, failed(PART, "pytest tests/gpu", f"no end after {timeout:g} s")]
    (out_dir / "tests-gpu.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    if not junit.exists():
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        return [failed(PART, "pytest tests/gpu", " | ".join(tail) or f"exit {done.returncode}")]
    rows = parse_junit(junit.read_text(encoding="utf-8"))
    if not rows:
        return [failed(PART, "pytest tests/gpu", f"no test ran (exit {done.returncode})")]
    return rows
