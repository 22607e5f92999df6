"""An environment's identity: one short hash of what is installed, the same on every node.

Standard library only, and runnable as a file on its own (``python3 envid.py [SITE...]``): the
node side of ``herd env`` sends this file to nodes that have nothing but a Python interpreter,
and the launcher hashes a lock or its own environment with the same two functions, so a lock, the
launcher and every node agree on what "the same environment" means.

The hash covers the Python minor version and every distribution's normalised name and version.
A local version label carries torch's build and CUDA variant (``2.13.0+cpu``, ``2.13.0+cu128``),
so a different variant is a different environment. The platform is not hashed: the same lock
resolved for an aarch64 node and an x86 node is the same environment, installed from the wheels
of each platform. Versions are read from the names of the ``*.dist-info`` directories (what
``importlib.metadata`` would find first on the path), which costs a directory listing, not an
import of every package's metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator

HASH_LENGTH = 12
"""Hex digits of the sha256 kept: short enough to read and type, long enough never to collide
between the few environments one cluster holds."""


def canonical(name: str) -> str:
    """A project name as PEP 503 normalises it (``Typing_Extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions(paths: list[str]) -> Iterator[tuple[str, str]]:
    """(project, version) of every distribution on ``paths`` (a sys.path), in import order, read
    from the names of their ``NAME-VERSION.dist-info`` (or egg-info) directories alone: opening
    every package's metadata costs more than the rest of a probe. The version may be empty."""
    for entry in paths:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:
            continue
        for name in names:
            stem, _, kind = name.rpartition(".")
            if kind not in ("dist-info", "egg-info"):
                continue
            project, _, version = stem.partition("-")
            if project:
                yield project, version.split("-")[0]  # an egg-info's "-pyX.Y" is not the version


def installed(paths: list[str]) -> dict[str, str]:
    """Every distribution on ``paths`` (a sys.path), name -> version; the first of a name wins,
    as it does for imports."""
    found: dict[str, str] = {}
    for project, version in distributions(paths):
        if version:
            found.setdefault(canonical(project), version)
    return found


def identity(packages: dict[str, str], python_version: str) -> str:
    """The hash of an environment: Python ``X.Y`` and every ``name==version``."""
    minor = ".".join(python_version.split(".")[:2])
    lines = [f"python=={minor}"]
    lines += sorted(f"{canonical(name)}=={version}" for name, version in packages.items())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:HASH_LENGTH]


def this_environment(paths: list[str] | None = None) -> dict[str, object]:
    """This interpreter's environment: its hash, Python version and packages."""
    packages = installed(list(sys.path if paths is None else paths))
    version = ".".join(str(v) for v in sys.version_info[:3])
    return {
        "hash": identity(packages, version),
        "python_version": version,
        "packages": packages,
    }


if __name__ == "__main__":
    # `python envid.py`: this interpreter's own environment (sys.path), as one JSON object.
    print(json.dumps(this_environment(sys.argv[1:] or None)))
