"""The transport a cluster asks for: ssh, this machine, Slurm or PBS.

The factory stands apart from ``base`` so that the base class knows none of its kinds (each
kind imports ``base``; ``base`` imports none of them). Kinds are imported when chosen: a local
job never loads the ssh or scheduler code.
"""

from __future__ import annotations

from ..spec import ClusterSpec
from .base import Transport


def for_cluster(cluster: ClusterSpec, *, tree: bool = False) -> Transport:
    """The transport a cluster asks for. ``tree``: over ssh, a cluster of more than
    ``tree_above`` nodes starts herd's agents through a tree of inner nodes (a launch's)."""
    if cluster.transport == "local":
        from .local import LocalTransport

        return LocalTransport(cluster)
    if cluster.transport == "slurm":
        from .slurm import SlurmTransport

        return SlurmTransport(cluster)
    if cluster.transport == "pbs":
        from .pbs import PbsTransport

        return PbsTransport(cluster)
    from .ssh import SshTransport

    return SshTransport(cluster, tree=tree)
