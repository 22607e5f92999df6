"""Slurm transport: the node agents of a launch are one job step across the allocation.

A 1,000-node job must not ask slurmctld for 1,000 steps at once nor hold 1,000 srun processes
on the launching node, so herd's agent commands (``python -m torchherd.agent probe|run|...``)
started together on many nodes become ONE step, a task per node:

    srun --nodes=K --ntasks=K --ntasks-per-node=1 --nodelist=N1,...,NK --kill-on-bad-exit=0
         --wait=0 --no-kill --cpus-per-task=C --overlap --quiet --label --input=all
         <shell> -c '<setup prelude>; cd W && env ... python -m torchherd.agent.relay'

Each task's relay connects back to the launcher and carries its node's command over a link of
its own (transport/relay.py), so every agent still has its own stdin, stdout and exit code.
``--kill-on-bad-exit=0`` and ``--wait=0``: one node's command ending, well or badly, must not end
the others' (a site's KillOnBadExit or WaitTime would); herd stops them itself when it decides
to. ``--no-kill``: a node Slurm marks down must not end the step's other tasks (the surviving
agents, the spares' included): herd notices the loss itself and decides (a spare, fewer nodes,
or a clean stop with the evidence). Other commands (``herd exec``'s wrapper, which must run
where torchherd is not installed yet) are one step per node, at most ``fanout`` at a time:

    srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=NODE --kill-on-bad-exit=1
         --cpus-per-task=C --overlap  <shell> -c '<setup prelude>; cd W && env ... command'

``--cpus-per-task`` is always explicit: srun 22.05-23.02 ignores SLURM_CPUS_PER_TASK, so a step
would otherwise get one CPU (and torch one thread); nodes with different CPU counts get steps
of their own. ``--overlap`` lets the probe, the agent and `herd exec` share the node's resources
with the batch step. What the batch script set up travels in the shell line (``carry_env``), as
over ssh; the launcher's ssh variables are not passed on (a node must not take the launcher's
SSH_CONNECTION for its own).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
from collections.abc import Iterable, Mapping

from ..agent.relay import BATCH_VAR, HOST_VAR, PORT_VAR
from ..errors import ConfigError
from ..spec import ClusterSpec, NodeSpec
from .base import DEFAULT_FANOUT, Command, Transport, Unreachable, agent_verb, shell_for
from .relay import (
    LIMIT,
    RelayServer,
    StepBatch,
    StepGatherer,
    relay_link_failure,
)

RELAY_MODULE = "torchherd.agent.relay"

# srun's words for a step that could not start on a node (not the task's own failure).
_STEP_FAILURES = (
    "Unable to create step",
    "Unable to create job step",
    "Invalid node name",
    "Requested node configuration is not available",
    "Unable to confirm allocation",
    "Job/step already completing",
    "Unable to contact slurm controller",
    "Socket timed out",
    "Invalid job id",
)
_NOT_PASSED_ON = ("SSH_CONNECTION", "SSH_CLIENT", "SSH_TTY", "SSH_AUTH_SOCK", "SLURM_CPUS_PER_TASK")


def cpus_per_node(hosts: tuple[str, ...], environ: Mapping[str, str]) -> dict[str, int]:
    """host -> allocated CPUs, from SLURM_JOB_CPUS_PER_NODE (``4,2(x3)`` follows the node list)."""
    counts: list[int] = []
    for item in environ.get("SLURM_JOB_CPUS_PER_NODE", "").split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match:
            counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != len(hosts):
        fallback = environ.get("SLURM_CPUS_ON_NODE", "")
        counts = [int(fallback) if fallback.isdigit() else 1] * len(hosts)
    return dict(zip(hosts, counts, strict=True))


def relayed(command: Command) -> bool:
    """Whether a command is one of herd's agent verbs (which run through a step's relay)."""
    return agent_verb(command)


def step_argv(srun: str, job_id: str | None, nodes: Iterable[str], cpus: int) -> list[str]:
    """srun for one task on each of ``nodes``, sharing the allocation with the other steps."""
    hosts = list(nodes)
    argv = [srun]
    if job_id:
        argv.append(f"--jobid={job_id}")
    return [
        *argv,
        f"--nodes={len(hosts)}",
        f"--ntasks={len(hosts)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(hosts)}",
        "--kill-on-bad-exit=0",
        "--wait=0",
        "--no-kill",
        f"--cpus-per-task={max(1, cpus)}",
        "--overlap",
        "--quiet",
        "--label",
        "--input=all",
    ]


def srun_argv(srun: str, job_id: str | None, node: str, cpus: int) -> list[str]:
    """srun for one task on one node, sharing the allocation with the other steps."""
    argv = [srun]
    if job_id:
        argv.append(f"--jobid={job_id}")
    return [
        *argv,
        "--nodes=1",
        "--ntasks=1",
        "--ntasks-per-node=1",
        f"--nodelist={node}",
        "--kill-on-bad-exit=1",
        f"--cpus-per-task={max(1, cpus)}",
        "--overlap",
        "--quiet",
    ]


class SlurmTransport(Transport):
    def __init__(
        self,
        cluster: ClusterSpec,
        fanout: int = DEFAULT_FANOUT,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        # No bound on each(): agent commands of many nodes are one step, not a process each;
        # the other commands are bounded below, one srun per node, `fanout` at a time.
        super().__init__(cluster, fanout=0)
        self.environ = dict(os.environ if environ is None else environ)
        srun = shutil.which("srun", path=self.environ.get("PATH"))
        if srun is None:
            raise ConfigError(
                "srun is not on PATH, but this is a Slurm allocation",
                "load Slurm's module (or add its bin directory to PATH) before herd",
            )
        self.srun = srun
        self.job_id = cluster.scheduler_job_id or self.environ.get("SLURM_JOB_ID")
        self.cpus = cpus_per_node(tuple(n.host for n in cluster.nodes), self.environ)
        self._single = asyncio.Semaphore(max(1, fanout))
        self._waiters: set[asyncio.Task[None]] = set()
        self._steps = StepGatherer(RelayServer(), self._start_step)

    async def connect(self, node: NodeSpec) -> Unreachable | None:
        # No link to keep: a node that cannot run a step is reported by the first command
        # (the probe), classified below.
        return None

    def argv(
        self, node: NodeSpec, command: Command, cwd: str | None, env: Mapping[str, str] | None
    ) -> list[str]:
        """One step of one task: how a command that is not an agent verb runs on a node."""
        line = self.shell_line(node, command, cwd, env)
        shell = shell_for(self.cluster.setup_for(node))
        return [
            *srun_argv(self.srun, self.job_id, node.host, self.cpus.get(node.host, 1)),
            shell,
            "-c",
            line,
        ]

    def _srun_env(self) -> dict[str, str]:
        return {k: v for k, v in self.environ.items() if k not in _NOT_PASSED_ON}

    async def start(
        self,
        node: NodeSpec,
        command: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> asyncio.subprocess.Process:
        if relayed(command):
            argv = [str(word) for word in command]
            relay = [argv[0], "-m", RELAY_MODULE]
            key = (
                shell_for(self.cluster.setup_for(node)),
                self.shell_line(node, relay, cwd, env),
                self.cpus.get(node.host, 1),
            )
            return await self._steps.start(key, node.name, node.host, argv)
        await self._single.acquire()
        try:
            process = await asyncio.create_subprocess_exec(
                *self.argv(node, command, cwd, env),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._srun_env(),
                limit=LIMIT,
            )
        except BaseException:
            self._single.release()
            raise
        waiter = asyncio.get_running_loop().create_task(self._release_after(process))
        self._waiters.add(waiter)
        waiter.add_done_callback(self._waiters.discard)
        return process

    async def _release_after(self, process: asyncio.subprocess.Process) -> None:
        try:
            await process.wait()
        finally:
            self._single.release()

    async def _start_step(self, batch: StepBatch, hosts: list[str]) -> asyncio.subprocess.Process:
        """srun for a batch: a relay on each host, told the token over the step's stdin."""
        shell, line, cpus = batch.key
        server = self._steps.server
        env = self._srun_env() | {
            PORT_VAR: str(server.port),
            BATCH_VAR: batch.batch,
            HOST_VAR: socket.gethostname(),
        }
        srun = await asyncio.create_subprocess_exec(
            *step_argv(self.srun, self.job_id, hosts, cpus),
            shell,
            "-c",
            line,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            limit=LIMIT,
        )
        assert srun.stdin is not None
        srun.stdin.write(f"{server.token}\n".encode())
        try:
            await srun.stdin.drain()
        except (ConnectionError, OSError):
            pass  # srun ended at once: its output says why
        srun.stdin.close()
        return srun

    async def close(self) -> None:
        """End the steps whose commands have all ended (and any left running)."""
        await self._steps.close()

    def classify_failure(self, node: NodeSpec, returncode: int, stderr: str) -> Unreachable | None:
        return classify_srun_failure(node.host, returncode, stderr)


def classify_srun_failure(host: str, returncode: int, stderr: str) -> Unreachable | None:
    """An Unreachable when srun could not start the step on ``host`` or its relay link failed;
    None for the command's own exit (its exit code is passed on)."""
    if returncode == 0:
        return None
    link = relay_link_failure(
        host,
        returncode,
        stderr,
        cannot_connect=f"{host} cannot open a TCP connection back to this machine (srun's own "
        "I/O needs the same): allow connections from the allocation's nodes to it",
        link_lost=f"check that {host} is up (`scontrol show node {host}`)",
    )
    if link is not None:
        return link
    lines = [line.strip() for line in stderr.splitlines() if line.strip().startswith("srun:")]
    for line in reversed(lines):
        if any(pattern in line for pattern in _STEP_FAILURES):
            return Unreachable(
                host,
                "srun-error",
                line,
                f"check the allocation still holds {host} (`squeue -j $SLURM_JOB_ID`, "
                f"`scontrol show node {host}`)",
            )
    return None
