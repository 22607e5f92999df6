"""Files herd keeps at rest: directories 0700, files 0600 (worker output may hold anything).

Worker output, job records and failure records may hold anything a job printed, so the
launcher's ``~/.herd/jobs/<id>/`` and the nodes' ``~/.herd/nodes/<job>/<node>/`` are private to
the user who ran herd, whatever the umask. Standard library only: the node agent uses it too.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import IO

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(
    path: str | os.PathLike[str], *, home: str | os.PathLike[str] | None = None
) -> Path:
    """Create ``path`` (and its missing parents) as 0700; return it.

    With ``home`` (herd's own tree, e.g. ``~/.herd``), every directory from ``home`` down to
    ``path`` is made 0700, including ones an older version left 0755. Without it, only what is
    created here gets 0700: a directory the user chose and made keeps its mode.
    """
    path = Path(os.path.abspath(os.fspath(path)))
    missing = []
    current = path
    while not current.is_dir() and current.parent != current:
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(DIR_MODE)  # parents too: Path.mkdir(parents=True) gives them 0755
        except FileExistsError:
            pass  # made by another process meanwhile
    chain = list(missing)  # set explicitly: mkdir's mode is filtered by the umask
    if home is not None:
        top = Path(os.path.abspath(os.fspath(home)))
        if top == path or top in path.parents:
            chain += [path, *(p for p in path.parents if p == top or top in p.parents)]
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
        pass  # not ours to change (a shared log directory): it stays as it is
    return os.fdopen(descriptor, mode, encoding="utf-8")


def write_private(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` atomically, as a file only this user can read."""
    path = Path(path)
    # Per process and thread: two writers never share a temporary file.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open_private(temporary, "w") as handle:
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
