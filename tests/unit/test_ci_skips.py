"""Under CI no test skips silently, not even a whole module skipped while it is collected
(tests/ci_skips.py). Each case runs a real pytest on a small test file, with and without CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ci_skips

REPO = Path(__file__).resolve().parents[2]

CASES = {
    "collection": (
        "import pytest\n"
        "pytest.importorskip('no_such_module_here', reason='needs an extra')\n"
        "def test_never_collected():\n    pass\n"
    ),
    "in_test": "import pytest\ndef test_skips():\n    pytest.skip('nothing to do here')\n",
    "mark": (
        "import pytest\n"
        "@pytest.mark.skipif(True, reason='never here')\n"
        "def test_marked():\n    pass\n"
        "def test_runs():\n    pass\n"
    ),
}


def run_pytest(directory: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "1"} if ci else {})
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.ci_skips",
            "--rootdir",
            str(directory),
            str(directory),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_skip_fails_under_ci_and_only_there(case: str, tmp_path: Path) -> None:
    (tmp_path / f"test_{case}.py").write_text(CASES[case])
    calm = run_pytest(tmp_path, ci=False)
    assert calm.returncode in (0, 5), calm.stdout  # 5: a skipped module leaves no tests
    assert "skipped" in calm.stdout
    strict = run_pytest(tmp_path, ci=True)
    assert strict.returncode != 0, strict.stdout
    assert "under CI" in strict.stdout
    if case == "mark":
        assert "1 passed, 1 error" in strict.stdout  # the rest of the file still ran


def test_a_module_skipped_at_collection_does_not_stop_the_others(tmp_path: Path) -> None:
    (tmp_path / "test_collection.py").write_text(CASES["collection"])
    (tmp_path / "test_fine.py").write_text("def test_fine():\n    pass\n")
    strict = run_pytest(tmp_path, ci=True)
    assert strict.returncode != 0
    assert "1 passed" in strict.stdout and "skipped at collection under CI" in strict.stdout


def test_only_the_gpu_tests_may_skip_under_ci() -> None:
    tests = Path(ci_skips.__file__).parent
    assert ci_skips.allowed(tests / "gpu" / "test_nccl.py")
    for path in (
        tests / "integration" / "test_third_party.py",
        tests / "unit" / "test_bench.py",
        tests / "unit" / "train" / "test_train_trackers.py",
        tests / "gpux" / "test_x.py",
    ):
        assert not ci_skips.allowed(path), path
