"""What the command line set for the whole run, whichever command reads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class State:
    debug: bool = False
    """--debug: let HerdErrors raise with their traceback instead of one message."""
    single_node: str | None = None
    """torchrun's ``--standalone`` or ``--nnodes 1`` as typed: what herd does on this machine
    with no cluster, refused where a cluster names other nodes (see cli/launch.py)."""


state = State()
