"""The launcher raises its open-files limit to what a large cluster needs (never lowers it)."""

from __future__ import annotations

import resource
import subprocess
import sys

from torchherd.transport.base import FDS_BESIDES, FDS_PER_NODE, raise_fd_limit

# A transport for 1,000 nodes built in a process whose soft limit is the common 1024.
CHILD = """
import resource
from torchherd.spec import ClusterSpec, NodeSpec
from torchherd.transport.local import LocalTransport
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
nodes = tuple(NodeSpec(host=f"n{i}") for i in range(1000))
LocalTransport(ClusterSpec(nodes=nodes, transport="local"))
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
"""


def test_a_transport_for_a_thousand_nodes_raises_the_soft_limit() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    soft, hard = (int(word) for word in done.stdout.split())
    assert soft == min(hard, FDS_BESIDES + FDS_PER_NODE * 1000) > 1024


def test_the_limit_is_never_lowered() -> None:
    before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert raise_fd_limit(1) == before
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == before
