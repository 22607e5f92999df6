"""``herd launch --env-sync`` (or ``[cluster] env_sync = true``): the job runs in one
environment, the same on every node, synced before it starts where a node differs.

The environment is named by its hash, so its interpreter has a fixed path on every node,
``ROOT/HASH/bin/python`` (never ``ROOT/current``, which another sync may move while the job
runs): that path becomes the cluster's python. The launch's own quick probe runs it and reports
the hash of what it finds, so comparing costs nothing beyond the probe every launch makes. A
node whose probe fails (the environment was never built there) or reports another hash (changed
by hand) is synced as ``herd env sync`` would (only what it lacks travels; its previous
environment stays until the new one is verified) and probed again; the others are not touched.

    probe (every node, ROOT/HASH/bin/python) -> differing nodes -> sync them -> probe them again
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, NodeNotReady
from ..spec import ClusterSpec, NodeSpec
from ..transport import Transport
from .identity import EnvTarget, choose
from .ship import DEFAULT_ROOT, EnvSync

AGENT = "torchherd"
"""The node agent runs in the environment too: it must hold torchherd."""


def root_for(cluster: ClusterSpec) -> str:
    """Where environments live on the nodes: ``env_root``, else inside a Slurm or PBS
    allocation the node's own scratch (``$TMPDIR`` as the scheduler sets it for the job, else
    /tmp: imports from a shared filesystem are slow at scale), else ~/.herd/envs."""
    if cluster.env_root:
        return cluster.env_root
    if cluster.transport in ("slurm", "pbs"):
        return f"{os.environ.get('TMPDIR') or '/tmp'}/herd-envs"
    return DEFAULT_ROOT


def target_for(cluster: ClusterSpec, project: Path | None = None) -> EnvTarget:
    """The environment of ``env_lock`` (else ./uv.lock, else the launcher's own)."""
    lock = Path(cluster.env_lock) if cluster.env_lock else None
    return choose(lock, project or Path.cwd())


@dataclass
class LaunchEnvironment:
    """The environment a launch runs in, and what it took to get every node there."""

    target: EnvTarget
    root: str
    folders: list[Path]
    synced: dict[str, float] = field(default_factory=dict)
    """Nodes synced before the start, and the seconds it took each."""
    sent_bytes: int = 0

    @property
    def python(self) -> str:
        return f"{self.root}/{self.target.hash}/bin/python"

    @classmethod
    def of(cls, cluster: ClusterSpec) -> LaunchEnvironment:
        target = target_for(cluster)
        if AGENT not in target.packages:
            raise ConfigError(
                f"the environment of {target.source} has no torchherd: with env_sync herd's "
                "node agent runs in it",
                f"add torchherd=={_own_version()} to {target.source} (or launch without "
                "--env-sync)",
            )
        return cls(target, root_for(cluster), [Path(f) for f in cluster.env_wheels])

    def cluster(self, cluster: ClusterSpec) -> ClusterSpec:
        """``cluster`` running this environment's python on every node."""
        nodes = tuple(n.model_copy(update={"python": None}) for n in cluster.nodes)
        return cluster.model_copy(update={"python": self.python, "nodes": nodes})

    def differing(self, hosts: list[str], hashes: Mapping[str, str | None]) -> list[str]:
        """The hosts whose probe did not answer (``hashes`` lacks them) or answered another
        hash, in cluster order."""
        return [h for h in hosts if hashes.get(h) != self.target.hash]

    async def sync(
        self,
        cluster: ClusterSpec,
        transport: Transport,
        hosts: list[str],
        say: Callable[[str], None],
    ) -> None:
        """Sync ``hosts`` (over the launch's own transport, left open); NodeNotReady naming
        each node that could not be synced, with why and the fix."""

        def progress(host: str, what: str) -> None:
            say(f"environment {self.target.hash} on {host}: {what}")

        runner = EnvSync(
            cluster.select(hosts), root=self.root, transport=transport, progress=progress
        )
        results = await runner.run_sync(self.target, self.folders)
        bad = [r for r in results if r.state in ("failed", "refused")]
        for r in results:
            if r.state not in ("failed", "refused"):
                self.synced[r.host] = r.seconds
                self.sent_bytes += r.bytes_sent
        if bad:
            lines = "\n".join(f"  {r.host}: {r.detail}" for r in bad)
            raise NodeNotReady(
                f"could not sync environment {self.target.hash} ({self.target.source}) on "
                f"{len(bad)} node(s); nothing was started:\n{lines}",
                "fix each node as said above, then launch again (only what is missing travels)",
                hosts=tuple(r.host for r in bad),
            )

    def summary(self, nodes: list[NodeSpec]) -> str:
        """One line for the launch's output: the environment and what was synced."""
        line = f"environment {self.target.hash} ({self.target.source}) on every node"
        if self.synced:
            names = ", ".join(self.synced)
            line += (
                f"; synced before the start: {names} ({self.sent_bytes / (1 << 20):.1f} MiB sent)"
            )
        else:
            line += f"; all {len(nodes)} already had it"
        return line


def _own_version() -> str:
    from .. import __version__

    return __version__
