"""The quick probe reads versions as importlib.metadata would, without importing it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from torchherd.agent.probe import _version


@pytest.mark.parametrize(
    "package",
    ["torch", "torchherd", "pydantic", "PyYAML", "typing-extensions", "typing_extensions"],
)
def test_versions_are_importlib_metadatas(package: str) -> None:
    assert _version(package) == importlib.metadata.version(package)


def test_a_missing_package_has_no_version() -> None:
    assert _version("no-such-package-here") is None


def test_the_first_on_sys_path_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "torch-0.0.1.dist-info").mkdir()
    (tmp_path / "old_egg-1.2-py3.11.egg-info").mkdir()
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert _version("torch") == "0.0.1"
    assert _version("old-egg") == "1.2"


def test_the_probe_does_not_import_importlib_metadata() -> None:
    code = "import sys, torchherd.agent.probe; print('importlib.metadata' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr
