"""Relay links (transport/relay.py, agent/relay.py): a node's command over a link of its own.

The launcher's end (RelayServer, StepGatherer, RelayedProcess) and the node's end (the relay)
are the real ones; the step that starts the relays is a local shell here, which starts one
relay per node and gives each the token on stdin, as ``srun --input=all`` does (the real srun
is in test_slurm.py). What is checked: a command's stdin, output and exit code travel over the
link; herd's own agent answers through it; cutting a link (kill) closes the command's stdin on
the node, which an agent takes as "stop the job"; a relay with a wrong token gets nothing to run.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
import time
from pathlib import Path

from torchherd.agent.relay import BATCH_VAR, PORT_VAR
from torchherd.transport.relay import (
    LINK_LOST,
    RelayedProcess,
    RelayServer,
    StepBatch,
    StepGatherer,
)

RELAY = [sys.executable, "-m", "torchherd.agent.relay"]


def local_step(token: str | None = None):  # type: ignore[no-untyped-def]
    """Starts a batch's relays as local processes, one per node, each told the token."""

    async def launch(batch: StepBatch, hosts: list[str]) -> asyncio.subprocess.Process:
        relays = " ".join(
            f"SLURMD_NODENAME={shlex.quote(host)} {shlex.join(RELAY)} <<EOF &\n$token\nEOF\n"
            for host in hosts
        )
        script = f"read -r token\n{relays}\nwait\n"
        env = dict(os.environ, **{PORT_VAR: str(server.port), BATCH_VAR: batch.batch})
        env["SLURM_LAUNCH_NODE_IPADDR"] = "127.0.0.1"
        step = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            script,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        assert step.stdin is not None
        step.stdin.write(f"{token or server.token}\n".encode())
        step.stdin.close()
        return step

    server = RelayServer()
    return server, launch


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def test_commands_of_many_nodes_are_one_step_each_with_its_own_link(tmp_path: Path) -> None:
    async def main() -> None:
        server, launch = local_step()
        steps = StepGatherer(server, launch)
        echo = [sys.executable, "-c", "import sys; print(sys.stdin.read().upper()); sys.exit(3)"]
        started = await asyncio.gather(
            *(steps.start("echo", f"node{k}", f"node{k}", echo) for k in range(3))
        )
        answers = await asyncio.gather(
            *(p.communicate(f"to node{k}".encode()) for k, p in enumerate(started))
        )
        assert [out.decode().strip() for out, _ in answers] == ["TO NODE0", "TO NODE1", "TO NODE2"]
        assert [p.returncode for p in started] == [3, 3, 3]
        assert len(steps.batches) == 1  # one step for the three nodes
        probe = [sys.executable, "-m", "torchherd.agent", "probe"]
        [facts] = [await steps.start("probe", "node0", "node0", probe)]
        out, err = await facts.communicate(json.dumps({"port": 0}).encode())
        assert facts.returncode == 0, err
        assert json.loads(out)["port"]["free"] is True
        await steps.close()

    run(main())


def test_a_cut_link_closes_the_commands_stdin_on_the_node(tmp_path: Path) -> None:
    ended = tmp_path / "ended"
    waits = (
        "import sys; print('ready', flush=True); sys.stdin.read(); "
        f"open({str(ended)!r}, 'w').write('stdin closed')"
    )

    async def main() -> RelayedProcess:
        server, launch = local_step()
        steps = StepGatherer(server, launch)
        process = await steps.start("wait", "node1", "node1", [sys.executable, "-c", waits])
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(b"still here\n")
        assert await process.stdout.readline() == b"ready\n"  # it runs on the node
        await asyncio.sleep(0.5)
        assert not ended.exists()
        process.kill()  # what the launcher does to a node that went silent
        assert await process.wait() == LINK_LOST
        deadline = time.monotonic() + 20
        while not ended.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await steps.close()
        return process

    run(main())
    assert ended.read_text() == "stdin closed"


def test_a_relay_with_a_wrong_token_gets_nothing_to_run(tmp_path: Path) -> None:
    touched = tmp_path / "ran"

    async def main() -> RelayedProcess:
        server, launch = local_step(token="not-the-token")
        steps = StepGatherer(server, launch)
        argv = [sys.executable, "-c", f"open({str(touched)!r}, 'w')"]
        process = await steps.start("x", "node1", "node1", argv)
        await process.wait()
        await steps.close()
        return process

    process = run(main())
    assert not touched.exists()
    assert process.returncode != 0  # finished from the step's words: it never connected
