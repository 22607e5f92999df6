"""Fixtures for the integration tests: one shared 4-node testbed (see tests/testbed.py).

Every test under tests/integration is marked `integration`. Where the testbed cannot be built
(not root, no sshd, no namespaces) the tests skip with the reason, except under CI (the `CI`
environment variable is set), where they fail: under CI any skip, of these tests or any other
but the GPU tests, at collection or while running, is a failure (tests/ci_skips.py). Outside CI
every skip is listed with its reason at the end of the run (pytest's `-rs`, set in
pyproject.toml).
"""

from __future__ import annotations

import fcntl
import json
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
    computed once for every recovery test that must end with the same losses: once per run,
    even when the tests run on several processes (pytest-xdist), which share the base of
    their temporary directories; the first to get there computes it, the others read it."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the base every worker's own directory sits in
    saved = shared / "uninterrupted-losses.json"
    with open(shared / "uninterrupted-losses.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait for the first one's run
        if not saved.exists():
            losses = run_uninterrupted(testbed, tmp_path_factory.mktemp("uninterrupted"))
            saved.write_text(json.dumps(losses))
    return [(int(step), float(loss)) for step, loss in json.loads(saved.read_text())]
