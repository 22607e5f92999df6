"""herd exec's fan-out, on this machine's local transport (real processes, no ssh)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from torchherd.ops.fanout import run_everywhere
from torchherd.spec import local_cluster


def tagged(tag: str) -> list[int]:
    wanted = f"HERD_TEST_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and wanted in Path(f"/proc/{entry}/environ").read_bytes().split(
                b"\0"
            ):
                found.append(int(entry))
        except OSError:
            pass
    return found


def test_lines_are_reported_per_stream_and_exit_codes_kept() -> None:
    lines: list[tuple[str, str, str]] = []
    results = run_everywhere(
        local_cluster(),
        "echo out; echo err >&2; exit 3",
        on_line=lambda h, s, t: lines.append((h, s, t)),
    )
    assert sorted(lines) == [("localhost", "e", "err"), ("localhost", "o", "out")]
    [result] = results
    assert (result.status, result.exit_code, result.ok) == ("failed", 3, False)
    assert result.duration > 0


def test_capture_and_shell_features() -> None:
    [result] = run_everywhere(local_cluster(), "printf 'a b\\n' | wc -w", capture=True)
    assert result.ok and result.stdout.strip() == "2"


def test_workdir_must_exist_when_configured(tmp_path: Path) -> None:
    cluster = local_cluster().model_copy(update={"workdir": str(tmp_path)})
    [result] = run_everywhere(cluster, "pwd", capture=True)
    assert result.stdout.strip() == str(tmp_path)
    missing = local_cluster().model_copy(update={"workdir": str(tmp_path / "nope")})
    [result] = run_everywhere(missing, "pwd", capture=True)
    assert result.status == "failed" and "does not exist" in result.stderr


def test_timeout_ends_the_whole_process_group() -> None:
    tag = uuid.uuid4().hex
    started = time.monotonic()
    # A child of a child: only a group kill reaches it.
    [result] = run_everywhere(
        local_cluster(), f"HERD_TEST_TAG={tag} sh -c 'sleep 60; true' & wait", timeout=0.5
    )
    assert result.status == "timeout" and not result.ok
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 5
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tagged(tag) == []


@pytest.mark.parametrize("words", [["true"], ["exit", "0"]])
def test_cli_exec_returns_zero_when_every_node_succeeds(
    words: list[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torchherd.cli import main

    monkeypatch.chdir(tmp_path)  # no herd.toml here: this machine alone
    assert main(["exec", "--", *words]) == 0
    out = capsys.readouterr().out
    assert out.split()[:4] == ["HOST", "EXIT", "TIME", "RESULT"] and "localhost" in out
