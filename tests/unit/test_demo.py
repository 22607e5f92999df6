"""`herd demo` itself, as a newcomer runs it: a real launch on this machine (agent, torchrun,
c10d, Gloo), two workers that train together, and a closing summary that says so. The launcher
itself never imports torch (only its workers do)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def test_herd_demo_trains_with_two_workers_and_cleans_up(tmp_path: Path) -> None:
    # `herd demo`, with a look at the launcher's own modules as it exits.
    as_herd = (
        "import atexit, sys; "
        "atexit.register(lambda: print('launcher imported torch:', 'torch' in sys.modules)); "
        "sys.argv = ['herd', 'demo']; from torchherd.cli import run; run()"
    )
    run = subprocess.run(
        [sys.executable, "-c", as_herd],
        env=dict(os.environ, HERD_HOME=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"\| hello from rank 0 of 2 ", out) and re.search(
        r"\| hello from rank 1 of 2 ", out
    )
    said = re.search(r"(\d+) workers joined .* loss went from ([\d.]+) to ([\d.]+)", out)
    assert said, out[-2000:]
    assert said.group(1) == "2"
    assert float(said.group(3)) < float(said.group(2)) / 10  # it learned
    assert "succeeded" in out
    assert "launcher imported torch: False" in out
    (job,) = (tmp_path / "jobs").iterdir()
    for rank in (0, 1):
        assert "hello from rank" in (job / f"rank-{rank}.log").read_text()
    # Nothing the demo started outlives it: no process carries its job id.
    tagged = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"HERD_JOB_ID={job.name}".encode() in environ:
            tagged.append(pid)
    assert not tagged
