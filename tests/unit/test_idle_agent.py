"""An idle agent (a hot spare's, a node's that came back) answers the launcher's pings, so the
launcher can tell it from one cut off and never chooses a dead spare. A real agent over pipes."""

from __future__ import annotations

import json
import subprocess
import sys


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
