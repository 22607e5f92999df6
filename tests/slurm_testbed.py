"""A real Slurm cluster (Debian's slurmctld, slurmd and munge) over a namespace Testbed.

munged and slurmctld run in the root namespace, the controller at the bridge address; each
testbed node runs its own slurmd (``slurmd -N nodeK``), with ``NodeAddr`` pinning its bridge
address. ``ip netns exec`` gives every node a fresh /sys that hides the cgroup hierarchy slurmd
22.05's cgroup plugin needs, so each node's mount namespace gets a tmpfs on /sys/fs/cgroup with the
v1 controllers under it. Configuration, state, spool, sockets and logs live in one temporary
directory; everything is stopped and removed on ``close()``, also after a failed start.

Clients (sbatch, srun, squeue, scontrol, herd) find this cluster through ``SLURM_CONF``: use
``slurm.env`` as the environment of anything that talks to it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.ports import free_port
from tests.testbed import Testbed, TestbedError

PACKAGES = {
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "munged": "munge",
}
_CGROUP_CONTROLLERS = ("freezer", "cpuset", "memory", "devices")


def slurm_available() -> tuple[bool, str]:
    """Whether Slurm's daemons and clients are installed (scripts/test installs them)."""
    missing = [
        package
        for program, package in PACKAGES.items()
        if shutil.which(program) is None and not Path("/usr/sbin", program).exists()
    ]
    if missing:
        return False, "Slurm is not installed (apt-get install " + " ".join(missing) + ")"
    return True, ""


def _program(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """Slurm on the nodes of ``bed``; a context manager. ``partition`` is the only partition."""

    __test__ = False

    def __init__(self, bed: Testbed, *, cpus: int = 2) -> None:
        self.bed = bed
        self.cpus = cpus
        self.tmp = Path()
        self.conf = Path()
        self.partition = "herd"
        self.env: dict[str, str] = {}
        self._processes: list[subprocess.Popen[bytes]] = []
        self._closed = False

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        ok, reason = slurm_available()
        if not ok:
            raise TestbedError(reason)
        assert self.bed.subnet is not None, "start the testbed first"
        self.tmp = Path(tempfile.mkdtemp(prefix="herd-slurm-"))
        os.chmod(self.tmp, 0o755)
        for sub in ("state", "spool", "log", "munge"):
            (self.tmp / sub).mkdir()
        for node in self.bed.nodes:
            (self.tmp / "spool" / node.name).mkdir()
        os.chmod(self.tmp / "munge", 0o700)
        self._start_munge()
        self._write_config()
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for name in ("SLURM_JOB_ID", "SLURM_JOBID", "PBS_JOBID", "PBS_NODEFILE"):
            self.env.pop(name, None)
        self._spawn(
            [_program("slurmctld"), "-D", "-i", "-f", str(self.conf)], self.tmp / "log" / "ctld.out"
        )
        for node in self.bed.nodes:
            mounts = "mount -t tmpfs herd-cgroup /sys/fs/cgroup"
            for controller in _CGROUP_CONTROLLERS:
                path = f"/sys/fs/cgroup/{controller}"
                mounts += f" && mkdir -p {path} && mount -t cgroup -o {controller} cgroup {path}"
            script = f'{mounts} && exec {_program("slurmd")} -D -N "$0" -f "$1"'
            log = open(self.tmp / "log" / f"{node.name}.out", "wb")  # noqa: SIM115
            with log:
                self._processes.append(
                    self.bed.ns_popen(
                        node,
                        ["sh", "-c", script, node.name, str(self.conf)],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        env=self.env,
                        start_new_session=True,
                    )
                )
        self._wait_idle()

    def close(self) -> None:
        """Stop every daemon this cluster started and remove its files; never raises."""
        if self._closed:
            return
        self._closed = True
        if self.conf != Path() and self.env:
            with contextlib.suppress(Exception):
                subprocess.run(
                    ["scancel", "--full", f"--partition={self.partition}"],
                    env=self.env,
                    capture_output=True,
                    timeout=10,
                )
        for proc in reversed(self._processes):
            with contextlib.suppress(Exception):
                proc.terminate()
        for proc in reversed(self._processes):
            with contextlib.suppress(Exception):
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        self._processes.clear()
        if self.tmp != Path():
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _spawn(self, argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        log = open(log_path, "wb")  # noqa: SIM115 - the child owns it
        with log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=self.env or None,
                start_new_session=True,
            )
        self._processes.append(proc)
        return proc

    def _start_munge(self) -> None:
        munge = self.tmp / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = munge / "munge.socket"
        self._spawn(
            [
                _program("munged"),
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            self.tmp / "log" / "munged.out",
        )
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if time.monotonic() > deadline:
                raise TestbedError("munged did not start: " + self._log("munged.out"))
            time.sleep(0.05)

    def _write_config(self) -> None:
        assert self.bed.subnet is not None
        bridge_addr = str(next(self.bed.subnet.hosts()))
        tmp = self.tmp
        lines = [
            "ClusterName=herdtest",
            # slurmctld runs only on the host its SlurmctldHost names: this machine, at the bridge.
            f"SlurmctldHost={socket.gethostname().split('.')[0]}({bridge_addr})",
            f"SlurmctldPort={free_port('')}",
            "SlurmdPort=6818",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: a requeued job waits out its credential's lifetime before it may
            # start again (120 s by default); 20 s here, so the requeue test waits 20 s.
            f"AuthInfo=socket={self.munge_socket},cred_expire=20",
            f"StateSaveLocation={tmp / 'state'}",
            f"SlurmdSpoolDir={tmp / 'spool'}/%n",
            f"SlurmctldPidFile={tmp / 'slurmctld.pid'}",
            f"SlurmdPidFile={tmp / 'spool'}/slurmd.%n.pid",
            f"SlurmctldLogFile={tmp / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={tmp / 'log'}/slurmd.%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MailProg=/bin/true",
            "KillWait=5",
            "MinJobAge=600",
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
            "JobRequeue=1",
        ]
        for node in self.bed.nodes:
            lines.append(
                f"NodeName={node.name} NodeAddr={node.addr} CPUs={self.cpus} "
                "RealMemory=1000 State=UNKNOWN"
            )
        lines.append(
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf = tmp / "slurm.conf"
        self.conf.write_text("\n".join(lines) + "\n")
        (tmp / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")

    def _log(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.tmp / "log" / name).read_text(errors="replace")[-3000:]
        return "(no log)"

    def _wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for proc in self._processes:
                if proc.poll() is not None:
                    raise TestbedError(
                        f"a Slurm daemon exited ({proc.args}): "
                        + self._log("slurmctld.log")
                        + "\n"
                        + "\n".join(self._log(f"{n.name}.out") for n in self.bed.nodes)
                    )
            proc = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=10,
            )
            last = proc.stdout + proc.stderr
            states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
            if len(states) == len(self.bed.nodes) and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        raise TestbedError(
            f"Slurm nodes not idle after {timeout:g} s: {last.strip()}\n"
            + self._log("slurmctld.log")
        )

    # ---- use -------------------------------------------------------------------------------

    def run(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster, from the root namespace."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        return subprocess.run(argv, env={**self.env, **kw.pop("env", {})}, **kw)

    def wait_job(self, job_id: str, timeout: float = 300) -> str:
        """Wait until the job has left the queue; its final state (scontrol's JobState)."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            proc = self.run(["scontrol", "show", "job", "-o", job_id])
            for field in proc.stdout.split():
                if field.startswith("JobState="):
                    state = field.split("=", 1)[1]
            if state in (
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
            ):
                return state
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {state or 'unknown'} after {timeout:g} s")

    def steps_launched(self, job_id: str) -> dict[str, set[str]]:
        """The job's steps as the nodes' slurmd logged them: step id -> the nodes it ran on."""
        steps: dict[str, set[str]] = {}
        for node in self.bed.nodes:
            with contextlib.suppress(OSError):
                text = (self.tmp / "log" / f"slurmd.{node.name}.log").read_text(errors="replace")
                for step in re.findall(rf"launch task StepId={re.escape(job_id)}\.(\w+) ", text):
                    steps.setdefault(step, set()).add(node.name)
        return steps

    def job_field(self, job_id: str, name: str) -> str:
        proc = self.run(["scontrol", "show", "job", "-o", job_id])
        for field in proc.stdout.split():
            if field.startswith(name + "="):
                return field.split("=", 1)[1]
        return ""
