"""Stacks that ptrace refuses: herd says why, with the fix, in the rank's stack file and under
the summary's stacks line (README: "ptrace must be allowed for py-spy"). The refusal is the
kernel's own: the real py-spy runs as an unprivileged user against a process of another user,
which ptrace refuses as it refuses an agent where ``kernel.yama.ptrace_scope`` forbids it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from torchherd.agent import stacks
from torchherd.logs import render_summary
from torchherd.recovery.evidence import Evidence
from torchherd.results import RunResult

NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="running py-spy as another user needs root")
def test_a_refused_dump_says_why_and_the_fix_next_to_the_missing_stack(tmp_path: Path) -> None:
    tool = stacks.py_spy()
    assert tool is not None, "py-spy is installed with torchherd"
    # py-spy where an unprivileged user can run it, and a wrapper that runs it as that user.
    shared = Path(tempfile.mkdtemp(prefix="herd-ptrace-"))
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        shared.chmod(0o755)
        spy = shared / "py-spy"
        shutil.copy(tool, spy)
        spy.chmod(0o755)
        as_nobody = shared / "py-spy-as-nobody"
        as_nobody.write_text(
            f'#!/bin/sh\nexec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups {spy} "$@"\n'
        )
        as_nobody.chmod(0o755)
        taken = stacks.dump(rank.pid, str(as_nobody))
    finally:
        rank.kill()
        rank.wait()
        shutil.rmtree(shared)
    assert "stack" not in taken, taken
    assert "Permission Denied" in taken["error"] and taken["error"].endswith(stacks.PTRACE_HINT)

    evidence = Evidence(tmp_path / "stacks")
    worker = {"rank": 0, "local_rank": 0, "pid": rank.pid, "state": "S", "error": taken["error"]}
    evidence.add("node1", {"reason": "taken as the job stops", "workers": [worker]})
    assert evidence.save([]) == tmp_path / "stacks"
    kept = (tmp_path / "stacks" / "node1-rank-0.txt").read_text()
    assert "no stacks: Permission Denied" in kept
    assert "sysctl kernel.yama.ptrace_scope=0" in kept and "CAP_SYS_PTRACE" in kept
    assert evidence.problems == [f"node1 rank 0: {taken['error']}"]
    summary = render_summary(
        RunResult(
            "job1", 1, stacks_dir=tmp_path / "stacks", evidence_problems=tuple(evidence.problems)
        )
    )
    assert f"  stacks missing: node1 rank 0: {taken['error']}" in summary.splitlines(), summary
