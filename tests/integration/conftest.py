"""Fixtures for the integration tests: one shared 4-node testbed (see tests/testbed.py).

Every test under tests/integration is marked `integration`. Where the testbed cannot be built
(not root, no sshd, no namespaces) the tests skip with the reason, except under CI (the `CI`
environment variable is set), where they fail: integration tests must never skip silently there.
Under CI any skip of an integration test, whatever raised it, is turned into a failure here, so a
skip added later cannot hide a broken fault either. Outside CI every skip is listed with its
reason at the end of the run (pytest's `-rs`, set in pyproject.toml).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.testbed import Testbed, testbed_available

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees every collected item of the session, so mark only the ones under this dir.
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not (os.environ.get("CI") and report.skipped and _HERE in Path(item.path).resolve().parents):
        return
    if hasattr(report, "wasxfail"):
        return  # an expected failure, reported as such
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"integration test skipped under CI (CI is set): {reason}"


def require_testbed() -> None:
    """Skip (or, under CI, fail) the calling test when no testbed can be built here."""
    ok, reason = testbed_available()
    if ok:
        return
    if os.environ.get("CI"):
        pytest.fail(f"integration testbed unavailable under CI: {reason}", pytrace=False)
    pytest.skip(f"integration testbed unavailable: {reason}")


@pytest.fixture(scope="session")
def testbed() -> Iterator[Testbed]:
    """Four nodes, each resolving its own name to 127.0.1.1 (stock Debian /etc/hosts)."""
    require_testbed()
    with Testbed(4, hosts_loopback=True) as bed:
        yield bed


@pytest.fixture
def clean_faults(testbed: Testbed) -> Iterator[Testbed]:
    """The shared testbed, with every fault a test injected reverted afterwards."""
    yield testbed
    testbed.reset_faults()
