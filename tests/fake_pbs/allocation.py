"""A FAKE PBS allocation over a namespace Testbed, reproducing what a real one looks like:

- ``$PBS_NODEFILE`` has one line per MPI process (``mpiprocs``), so hosts repeat, and the names
  are fully qualified (``node1.fakepbs.test``);
- the PBS_* variables exist only where the batch script runs: the first node ("mother
  superior"); the other nodes are reached over ssh (herd) or the fake pbsdsh;
- qsub/qstat/qdel/pbsdsh/pbs_attach are the FAKE commands of ``bin/``, first on PATH.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.testbed import Testbed

BIN = Path(__file__).resolve().parent / "bin"
DOMAIN = "fakepbs.test"


class FakePbsAllocation:
    """A FAKE PBS job holding every node of ``bed``; ``run()`` runs on its first node."""

    __test__ = False

    def __init__(
        self, bed: Testbed, directory: Path, *, mpiprocs: int = 2, job_id: str | None = None
    ) -> None:
        self.bed = bed
        self.dir = directory
        # A fresh id per allocation: the fake pbs_attach records its calls under it.
        self.job_id = job_id or f"{random.randrange(10**6)}.fakepbs"
        directory.mkdir(parents=True, exist_ok=True)
        self.nodefile = directory / "nodefile"
        self.nodefile.write_text("".join(f"{n.name}.{DOMAIN}\n" * mpiprocs for n in bed.nodes))
        # ssh must know the fully qualified names: the testbed's own aliases, widened.
        config = bed.ssh_config.read_text()
        for node in bed.nodes:
            config = re.sub(
                rf"^Host {node.name} ",
                f"Host {node.name} {node.name}.{DOMAIN} ",
                config,
                flags=re.M,
            )
        self.ssh_config = directory / "ssh_config"
        self.ssh_config.write_text(config)
        self.set_walltime("01:00:00", "00:00:00")

    def set_walltime(self, limit: str, used: str) -> None:
        """What the FAKE qstat says of this job's walltime."""
        jobs_file = self.dir / "jobs.json"
        jobs = json.loads(jobs_file.read_text()) if jobs_file.exists() else {}
        jobs[self.job_id] = {
            "job_state": "R",
            "Resource_List": {"walltime": limit, "select": "3:ncpus=2:mpiprocs=2"},
            "resources_used": {"walltime": used},
        }
        jobs_file.write_text(json.dumps(jobs))

    def env(self, **extra: str) -> dict[str, str]:
        """The first node's environment inside the job (the batch script's)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "PBS_")) and k not in ("SSH_CONNECTION",)
        }
        env.update(
            PATH=f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}",
            PBS_JOBID=self.job_id,
            PBS_NODEFILE=str(self.nodefile),
            PBS_O_WORKDIR=os.getcwd(),
            PBS_ENVIRONMENT="PBS_BATCH",
            PBS_QUEUE="workq",
            NCPUS="2",
            FAKE_PBS_DIR=str(self.dir),
            FAKE_PBS_SSH_CONFIG=str(self.ssh_config),
            PYTHONUNBUFFERED="1",
        )
        env.update(extra)
        return env

    def run(
        self, argv: list[str], *, cwd: Path, timeout: float = 300, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """Run argv on the first node, inside the FAKE job."""
        return self.bed.ns_run(0, argv, cwd=cwd, env=self.env(**env), timeout=timeout, check=False)

    def herd(self, args: list[str], *, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
        return self.run([sys.executable, "-m", "torchherd", *args], cwd=cwd, **env)

    def settings(self, path: Path, **cluster: Any) -> Path:
        """A herd.toml holding the [cluster] settings for the job (the nodes come from PBS)."""
        return self.bed.write_cluster_file(
            path,
            nodes=[f"node1.{DOMAIN}"],
            ssh_config=str(self.ssh_config),
            **cluster,
        )

    def calls(self, command: str | None = None) -> list[dict[str, Any]]:
        """What the FAKE commands were given (pbs_attach's calls live under the job id)."""
        found = []
        for path in (self.dir / "calls.jsonl", self.attach_calls):
            if path.exists():
                found += [json.loads(line) for line in path.read_text().splitlines()]
        return [c for c in found if command is None or c["command"] == command]

    @property
    def attach_calls(self) -> Path:
        return Path(tempfile.gettempdir()) / "fake-pbs-attach" / f"{self.job_id}.jsonl"
