"""Files herd keeps at rest: directories 0700, files 0600 (worker output may hold anything)."""

from __future__ import annotations

import os
from pathlib import Path


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and its parents) readable by this user only; return it."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` atomically, as a file only this user can read."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temporary, path)
