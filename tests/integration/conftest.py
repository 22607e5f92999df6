"""Fixtures for the integration tests: one shared 4-node testbed (see tests/testbed.py).

Every test under tests/integration is marked `integration`. Where the testbed cannot be built
(not root, no sshd, no namespaces) the tests skip with the reason, except under CI (the `CI`
environment variable is set), where they fail: under CI any skip, of these tests or any other
but the GPU tests, at collection or while running, is a failure (tests/ci_skips.py). Outside CI
every skip is listed with its reason at the end of the run (pytest's `-rs`, set in
pyproject.toml).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.training import run_uninterrupted
from tests.testbed import Testbed, testbed_available

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees every collected item of the session, so mark only the ones under this dir.
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.integration)


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


@pytest.fixture(scope="session")
def uninterrupted_losses(
    testbed: Testbed, tmp_path_factory: pytest.TempPathFactory
) -> list[tuple[int, float]]:
    """(step, loss) of the slowed Trainer job never interrupted (tests/integration/training.py),
    computed once for every recovery test that must end with the same losses."""
    return run_uninterrupted(testbed, tmp_path_factory.mktemp("uninterrupted"))
