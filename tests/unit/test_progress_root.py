"""Node-local progress storage (agent.attempt.progress_root): ``herd-<uid>`` in a shared
directory is used only when it is this user's own; one taken first by another user, or a link,
sends herd to the next place. Real directories, a real other owner (root can chown)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from torchherd.agent import attempt


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attempt, "_progress_root", None, raising=False)


def test_the_runtime_directory_is_used_and_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    loose = tmp_path / f"herd-{os.getuid()}"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o777)
    assert attempt.progress_root() == str(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory another user's needs root")
def test_a_directory_another_user_made_first_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    taken = tmp_path / f"herd-{os.getuid()}"
    taken.mkdir(mode=0o777)
    os.chown(taken, 54321, 54321)
    root = attempt.progress_root()
    assert root != str(taken)
    found = os.lstat(root)
    assert found.st_uid == os.getuid() and stat.S_IMODE(found.st_mode) == 0o700


def test_a_link_planted_in_its_place_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run" / f"herd-{os.getuid()}").symlink_to(elsewhere)
    root = attempt.progress_root()
    assert not root.startswith(str(tmp_path / "run")), root
    assert not os.path.islink(root) and os.lstat(root).st_uid == os.getuid()
