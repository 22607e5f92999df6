"""Slurm transport: each node's agent is one job step, started with srun inside the allocation.

Exactly one task per node, never one per allocated CPU or GPU:

    srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=NODE --kill-on-bad-exit=1
         --cpus-per-task=C --overlap  <shell> -c '<setup prelude>; cd W && env ... python -m ...'

``--cpus-per-task`` is always explicit: srun 22.05-23.02 ignores SLURM_CPUS_PER_TASK, so a step
would otherwise get one CPU (and torch one thread). ``--overlap`` lets the probe, the agent and
`herd exec` share the node's resources with the batch step. The step's stdin/stdout/stderr are
srun's, so the agent's JSON-lines channel is exactly what it is over ssh, and closing srun's
stdin closes the agent's (which ends its job). What the batch script set up travels in the shell
line (``carry_env``), as over ssh; the launcher's ssh variables are not passed on (a node must not
take the launcher's SSH_CONNECTION for its own).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import Mapping

from ..errors import ConfigError
from ..spec import ClusterSpec, NodeSpec
from .base import Command, Transport, Unreachable, shell_for

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
        self, cluster: ClusterSpec, fanout: int = 64, environ: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(cluster, fanout)
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

    async def connect(self, node: NodeSpec) -> Unreachable | None:
        # No link to keep: every command is its own step. A node that cannot run one is
        # reported by the first command (the probe), classified below.
        return None

    def argv(
        self, node: NodeSpec, command: Command, cwd: str | None, env: Mapping[str, str] | None
    ) -> list[str]:
        line = self.shell_line(node, command, cwd, env)
        shell = shell_for(self.cluster.setup_for(node))
        return [
            *srun_argv(self.srun, self.job_id, node.host, self.cpus.get(node.host, 1)),
            shell,
            "-c",
            line,
        ]

    async def start(
        self,
        node: NodeSpec,
        command: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> asyncio.subprocess.Process:
        srun_env = {k: v for k, v in self.environ.items() if k not in _NOT_PASSED_ON}
        return await asyncio.create_subprocess_exec(
            *self.argv(node, command, cwd, env),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=srun_env,
            limit=1 << 24,
        )

    def classify_failure(self, node: NodeSpec, returncode: int, stderr: str) -> Unreachable | None:
        return classify_srun_failure(node.host, returncode, stderr)


def classify_srun_failure(host: str, returncode: int, stderr: str) -> Unreachable | None:
    """An Unreachable when srun could not start the step on ``host``; None for the task's own
    exit (srun then passes the task's exit code on)."""
    if returncode == 0:
        return None
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
