"""The uv binary the launcher uses and ships to nodes that lack it (from the ``uv`` wheel,
a dependency of torchherd; a ``uv`` on PATH otherwise)."""

from __future__ import annotations

import shutil
import subprocess
from functools import cache

from ..errors import ConfigError


@cache
def uv_binary() -> str:
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found:
            return found
    raise ConfigError(
        "uv is not installed here (herd env installs every node's environment with it)",
        remedy="pip install uv",
    )


@cache
def uv_version() -> str:
    """``0.13.0``: names the binary on the nodes, so a node keeps one copy per version."""
    out = subprocess.run([uv_binary(), "--version"], capture_output=True, text=True, check=True)
    return out.stdout.split()[1]
