"""Transports start commands on nodes: over the user's OpenSSH client, or as local processes.

Only transports (and the node agent) do I/O against nodes. Everything above them takes a
Transport, so a test can pass a different one where a real one cannot run.
"""

from .base import CommandResult, Transport, Unreachable
from .factory import for_cluster

__all__ = ["CommandResult", "Transport", "Unreachable", "for_cluster"]
