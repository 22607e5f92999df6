"""Agent links on real subprocesses: a node whose words wait unread is not silent."""

from __future__ import annotations

import asyncio
import sys

from torchherd.links import AgentLink
from torchherd.spec import NodeSpec

SPEAKS_THEN_WAITS = (
    'import sys, time\nsys.stdout.write(\'{"e": "alive"}\\n\' * 100)\nsys.stdout.flush()\n'
    "time.sleep(5)\n"
)


def test_unread_words_mean_the_launcher_is_behind_not_the_node_silent() -> None:
    async def main() -> tuple[bool, bool, int]:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            SPEAKS_THEN_WAITS,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        link = AgentLink(NodeSpec(host="n1"), process, fresh=False)
        heard: list[dict[str, object]] = []
        try:
            await asyncio.sleep(1.0)  # the node spoke; nobody has handled it yet
            before = link.has_unread()
            link.on_event = heard.append
            link.start_reading()
            await asyncio.sleep(0.5)
            return before, link.has_unread(), len(heard)
        finally:
            link.cut()
            await link.wait_ended(5)

    before, after, count = asyncio.run(main())
    assert before and not after and count == 100
