"""Under CI (the ``CI`` environment variable set) no test may be skipped silently.

A skip outside CI is a reason worth reading (pytest lists them all, ``-rs``); under CI it would
hide a missing dependency or a broken fixture, so every skip becomes a failure, wherever it
comes from: ``pytest.skip`` in a test or fixture, a ``skipif`` mark, or a skip at collection
time (a module-level ``pytest.importorskip``, which skips a whole file before any of its tests
exist and so escapes a per-test check). Only what cannot run on a CI machine at all is allowed
to skip there: ``ALLOWED`` (the GPU tests).

Loaded by tests/conftest.py for the whole suite.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ALLOWED = (TESTS / "gpu",)
"""Directories whose tests may skip under CI: they need hardware a CI machine does not have."""


def under_ci() -> bool:
    return bool(os.environ.get("CI"))


def allowed(path: Path | str) -> bool:
    resolved = Path(path).resolve()
    return any(resolved == root or root in resolved.parents for root in ALLOWED)


def _reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def pytest_configure(config: pytest.Config) -> None:
    if under_ci():
        # A module skipped at collection is turned into a collection error below: let the
        # rest of the suite run all the same (the session fails either way).
        config.option.continue_on_collection_errors = True


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if under_ci() and report.skipped and not allowed(collector.path):
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid or collector.path}: skipped at collection under CI (CI is "
            f"set), so none of its tests ran: {_reason(report.longrepr)}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not (under_ci() and report.skipped) or allowed(item.path):
        return
    if hasattr(report, "wasxfail"):
        return  # an expected failure, reported as such
    report.outcome = "failed"
    report.longrepr = f"test skipped under CI (CI is set): {_reason(report.longrepr)}"
