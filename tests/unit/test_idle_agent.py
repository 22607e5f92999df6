"""An idle agent (a hot spare's, a node's that came back) answers the launcher's pings, so the
launcher can tell it from one cut off and never chooses a dead spare. A real agent over pipes."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path


def test_an_idle_agent_answers_pings_and_leaves_on_bye() -> None:
    agent = subprocess.Popen(
        [sys.executable, "-m", "torchherd.agent", "run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert agent.stdin is not None and agent.stdout is not None
    try:
        for _ in range(2):
            agent.stdin.write(b'{"cmd": "ping"}\n')
            agent.stdin.flush()
            assert json.loads(agent.stdout.readline()) == {"e": "alive"}
        agent.stdin.write(b'{"cmd": "bye"}\n')
        agent.stdin.flush()
        assert agent.wait(timeout=30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


def test_an_attempts_commands_reach_that_attempt_only(tmp_path: Path) -> None:
    """A stop meant for attempt 0 reaches an agent running attempt 1: ignored (the attempt
    runs on, well past the 1 s grace); a stop for attempt 1 ends it. A real agent and a real
    worker process."""
    job = f"cmds-{uuid.uuid4().hex[:6]}"
    request = {
        "job_id": job,
        "node": "n1",
        "grace": 1,
        "env": {"HERD_HOME": str(tmp_path / "home"), "HERD_ATTEMPT": "1"},
        "argv": [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
    }
    agent = subprocess.Popen(
        [sys.executable, "-m", "torchherd.agent", "run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert agent.stdin is not None and agent.stdout is not None
    events: queue.Queue[dict[str, object]] = queue.Queue()

    def read() -> None:
        assert agent.stdout is not None
        for line in agent.stdout:
            events.put(json.loads(line))

    def until(kind: str, within: float) -> dict[str, object] | None:
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = events.get(timeout=left)
            except queue.Empty:
                break
            if event["e"] == kind:
                return event
        return None

    threading.Thread(target=read, daemon=True).start()
    try:
        agent.stdin.write(json.dumps(request) + "\n")
        agent.stdin.flush()
        assert until("started", 60) is not None
        agent.stdin.write(json.dumps({"cmd": "stop", "attempt": 0}) + "\n")
        agent.stdin.flush()
        assert until("exit", 4) is None  # the previous attempt's stop: not this attempt's
        agent.stdin.write(json.dumps({"cmd": "stop", "attempt": 1}) + "\n")
        agent.stdin.flush()
        ended = until("exit", 30)
        assert ended is not None and ended["a"] == "1" and ended["stopped"] is True, ended
    finally:
        agent.stdin.close()
        try:
            agent.wait(timeout=30)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
