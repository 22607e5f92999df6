"""A simulated cluster for measuring herd's control plane: N nodes on this machine.

Every node runs herd's real node agent (``python -m torchherd.agent ...``, the code a real node
runs: probe, agent, verbs), started through SimulatedHosts, a transport where each node is a
host of its own and needs no sshd. Only torch is stood in for: a node's python is a shim that
starts the torchrun stand-in (standin.py) where the agent starts torchrun's wrapper. The
launcher (launcher.py) is herd's own launch, as one process that a benchmark can measure.
"""

from .cluster import SimCluster
from .transport import SimulatedHosts

__all__ = ["SimCluster", "SimulatedHosts"]
