"""What the command line set for the whole run, whichever command reads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class State:
    debug: bool = False
    """--debug: let HerdErrors raise with their traceback instead of one message."""


state = State()
