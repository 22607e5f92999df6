"""Node-local progress storage (agent.attempt.progress_root): ``herd-<uid>`` in a shared
directory is used only when it is this user's own; one taken first by another user, or a link,
sends herd to the next place; a real attempt's worker beats there, never in a home. Real
directories, a real other owner (root can chown), a real worker process."""

from __future__ import annotations

import os
import stat
import sys
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


# A worker: beats at step 7 from the progress folder herd gives it, and says where that is;
# it lives on past the agent's next periodic report (every second), so that report sends the
# beat and the attempt's last report before its exit event must not send it again.
WORKER = """
import os, time
from torchherd.progress import beat
beat(7, now=True)
where = os.environ["HERD_PROGRESS_DIR"]
print("PROGRESS", where, sorted(os.listdir(where)))
time.sleep(1.5)
"""


def test_an_attempts_progress_files_live_there_never_in_a_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real attempt on this node: its worker's beats go to the runtime directory's
    ``herd-<uid>``, not to the home or HERD_HOME (an NFS home that stalls would freeze a
    beat), reach the launcher, and the folder is gone once the attempt has ended."""
    runtime, home = tmp_path / "run", tmp_path / "home"
    runtime.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("HOME", str(home))
    events: list[dict[str, object]] = []
    request = {
        "job_id": "job1",
        "node": "node1",
        "argv": [sys.executable, "-c", WORKER],
        "env": {"HERD_HOME": str(home / ".herd"), "RANK": "0", "LOCAL_RANK": "0"},
        "grace": 1,
    }
    assert attempt.NodeAttempt(request, events.append).run() == 0
    said = [str(e["t"]) for e in events if e.get("e") == "line"]
    where = f"{runtime}/herd-{os.getuid()}/job1/node1/attempt-0"
    assert any(line.startswith(f"PROGRESS {where} ['rank-0") for line in said), (said, events)
    assert [b[:2] for e in events if e.get("e") == "beats" for b in e["b"]] == [[0, 7]], events
    assert not os.path.exists(where) and not os.path.exists(os.path.dirname(where))
    assert not home.exists() or not list(home.rglob("rank-0*"))
