"""The node agent on this machine (no testbed needed): it reaps the orphans a worker leaves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"


def test_agent_reaps_orphans_of_its_workers(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torchherd", "launch", "--nproc", "1", "orphans.py"],
        cwd=SCRIPTS,
        env=dict(os.environ, HERD_HOME=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"ZOMBIES (\d+) under agent", done.stdout)
    assert found is not None, done.stdout
    assert int(found.group(1)) == 0, done.stdout


def tagged(job_id: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"HERD_JOB_ID={job_id}".encode() in environ:
                found.append(int(entry))
    return found


def test_a_prewarmed_wrapper_runs_the_job_it_is_handed(tmp_path: Path) -> None:
    """The agent starts torchrun's wrapper before the request (it imports torch meanwhile),
    and the job then runs in that very process."""
    job_id = f"prewarm-{os.getpid()}"
    agent = subprocess.Popen(
        [sys.executable, "-m", "torchherd.agent", "run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, HERD_HOME=str(tmp_path)),
    )
    assert agent.stdin is not None and agent.stdout is not None
    prewarm = {"python": sys.executable, "workdir": str(SCRIPTS), "job_id": job_id, "node": "n1"}
    prewarm["attempt"] = 2
    agent.stdin.write(json.dumps({"prewarm": prewarm}).encode() + b"\n")
    agent.stdin.flush()
    deadline = time.monotonic() + 30
    while not tagged(job_id):
        assert time.monotonic() < deadline, "no prewarmed wrapper started"
        time.sleep(0.05)
    (wrapper,) = tagged(job_id)
    # Tagged with its attempt too: a sweep of a lost earlier attempt leaves it alone.
    assert b"HERD_ATTEMPT=2" in Path(f"/proc/{wrapper}/environ").read_bytes().split(b"\0")
    argv = [sys.executable, "-m", "torchherd.agent.elastic", "--standalone"]
    argv += ["--nproc-per-node=1", "--max-restarts=0", "--tee=3", "orphans.py"]
    env = {"HERD_ATTEMPT": "2"}  # the attempt the wrapper was warmed for
    request = {"job_id": job_id, "node": "n1", "workdir": str(SCRIPTS), "argv": argv, "env": env}
    agent.stdin.write(json.dumps(request).encode() + b"\n")
    agent.stdin.flush()
    events = [json.loads(line) for line in agent.stdout]
    agent.wait(timeout=120)
    started = next(e for e in events if e.get("e") == "started")
    ended = next(e for e in events if e.get("e") == "exit")
    assert started["pid"] == wrapper and ended["code"] == 0, events
    # Worker lines come in batches: {"e": "lines", "b": [[rank, local rank, stream, text]...]}.
    texts = [line[3] for e in events if e.get("e") == "lines" for line in e["b"]]
    assert any("ZOMBIES 0" in text for text in texts), events
