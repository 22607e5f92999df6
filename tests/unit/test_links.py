"""Agent links on real subprocesses: a node whose words wait unread is not silent; the probe
asked over a link, and what happens when the agent cannot answer it."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

from torchherd.launcher.links import AgentLink
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


async def agent_link(*argv: str) -> AgentLink:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    return AgentLink(NodeSpec(host="n1"), process, fresh=True)


def test_the_agent_answers_the_probe_over_its_link_then_waits_for_the_job(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The probe over the link gives the facts of `agent probe`; the agent still waits for
    its first job request (the link stays fresh) and leaves when told."""
    (tmp_path / "train.py").write_text("print(1)\n")

    async def main() -> tuple[dict[str, object] | None, bool, int | None]:
        link = await agent_link(sys.executable, "-m", "torchherd.agent", "run")
        request = {"full": False, "workdir": str(tmp_path), "entry": {"script": "train.py"}}
        try:
            facts = await link.probe(request, timeout=30)
            still_waiting = link.alive
            link.write({"cmd": "bye"})
            return facts, still_waiting and link.fresh, await link.process.wait()
        finally:
            link.cut()
            await link.process.wait()

    facts, waited, code = asyncio.run(main())
    assert facts is not None
    assert facts["hostname"] == socket.gethostname()
    assert facts["python"] == sys.executable
    assert facts["workdir_exists"] is True and facts["entry"]["found"] is True, facts  # type: ignore[index]
    assert waited and code == 0


def test_a_link_that_cannot_answer_the_probe_gives_none_for_the_usual_probe() -> None:
    """An agent that ended (no python, no torchherd) or ignores the question (an older
    version) answers nothing: the caller probes in a session of its own."""

    async def main() -> tuple[object, object, float]:
        ended = await agent_link(sys.executable, "-c", "import sys; sys.exit(3)")
        ignores = await agent_link(sys.executable, "-c", "import sys, time; time.sleep(30)")
        try:
            gone = await ended.probe({"full": False}, timeout=10)
            asked = time.monotonic()
            silent = await ignores.probe({"full": False}, timeout=1.0)
            return gone, silent, time.monotonic() - asked
        finally:
            for link in (ended, ignores):
                link.cut()
                await link.process.wait()

    gone, silent, waited = asyncio.run(main())
    assert gone is None and silent is None
    assert waited < 10  # the wait for an agent that ignores the question is bounded
