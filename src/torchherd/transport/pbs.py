"""PBS transport: ssh between the nodes of a PBS allocation, each agent attached to the job.

Why ssh and not pbsdsh: pbsdsh starts one task per nodefile line (two per node with mpiprocs=2),
gives them no stdin (the agent's channel), starts them in $HOME with the job's base environment
(no module, no venv), and exits 0 whatever they did, so a failure on another node could not be
seen. ssh gives one agent per host, a real stdin/stdout channel and real exit codes; the plan's
addresses come from SSH_CONNECTION as they do over ssh anywhere. Processes started over ssh live
outside the job, so where PBS provides ``pbs_attach`` every agent runs under
``pbs_attach -j $PBS_JOBID``: walltime and qdel reach it. What the batch script set up (PATH,
venv, NCCL_*, ...) travels in the shell line (``carry_env``) together with the setup prelude.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Mapping

from ..spec import ClusterSpec, NodeSpec
from .base import Command, shell_for
from .ssh import SshTransport


class PbsTransport(SshTransport):
    def __init__(
        self, cluster: ClusterSpec, fanout: int = 64, environ: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(cluster, fanout)
        environ = os.environ if environ is None else environ
        self.job_id = cluster.scheduler_job_id or environ.get("PBS_JOBID")
        # Nodes of one allocation share their software: where the first node has pbs_attach,
        # every node has it, at the same path (a remote non-login PATH may not hold it).
        self.pbs_attach = shutil.which("pbs_attach", path=environ.get("PATH"))

    def shell_line(
        self,
        node: NodeSpec,
        command: Command,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        line = super().shell_line(node, command, cwd, env)
        if not self.pbs_attach or not self.job_id:
            return line
        shell = shell_for(self.cluster.setup_for(node))
        return shlex.join([self.pbs_attach, "-j", self.job_id, shell, "-c", line])
