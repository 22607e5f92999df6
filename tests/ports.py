"""A port nobody listens on now, for the servers and jobs the tests start."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the system just gave out on ``host`` ("" for every address) and took back; a
    process started right after may take it."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
