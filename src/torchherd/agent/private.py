"""Files at rest for their owner only: herd's directories 0700, its files 0600.

Worker output, job records and failure records may hold anything a job printed, so the
launcher's ``~/.herd/jobs/<id>/`` and the nodes' ``~/.herd/nodes/<job>/<node>/`` are private to
the user who ran herd. Standard library only: the node agent uses it as well as the launcher.
"""

from __future__ import annotations

import os
import tempfile
from typing import IO

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str | os.PathLike[str], *, home: str | os.PathLike[str] | None = None) -> str:
    """Create ``path`` (and its missing parents) as 0700; return it.

    With ``home`` (herd's own tree, e.g. ``~/.herd``), every directory from ``home`` down to
    ``path`` is made 0700, including ones an older version left 0755. Without it, only what is
    created here gets 0700: a directory the user chose and made keeps its mode.
    """
    path = os.path.abspath(os.fspath(path))
    missing = []
    current = path
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            pass  # made by another process meanwhile
    if home is not None:
        top = os.path.abspath(os.fspath(home))
        chain = [path]
        while chain[-1] != top and os.path.dirname(chain[-1]) != chain[-1]:
            chain.append(os.path.dirname(chain[-1]))
        if chain[-1] == top:
            for directory in chain:
                os.chmod(directory, DIR_MODE)
    return path


def open_private(path: str | os.PathLike[str], mode: str = "a") -> IO[str]:
    """Open a text file (``"a"`` or ``"w"``) that only its owner can read; an existing file
    is tightened to 0600 first."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    descriptor = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(descriptor, FILE_MODE)
    except OSError:
        pass  # not ours (a shared log dir): what it already is
    return os.fdopen(descriptor, mode, encoding="utf-8")


def write_private(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` atomically with ``text``, mode 0600 (a reader never sees half a file)."""
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path))
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
