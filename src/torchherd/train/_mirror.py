"""A local folder mirrored to a run directory URL, for files that are appended to.

Object stores cannot append, and rewriting an object on every step would cost a request per
step. So with ``run_dir = s3://...`` rank 0 writes ``metrics.jsonl`` and TensorBoard events
into a local folder and uploads them: at most every ``every`` seconds while training, and at
the end. On start, the files already at the URL (a restarted job) are downloaded first, so
the resumed run continues them instead of starting them over.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from torchherd.train._store import filesystem

__all__ = ["RunDirMirror"]


class RunDirMirror:
    """Keeps ``local`` (a fresh temporary folder) and the URL ``remote`` in step."""

    def __init__(self, remote: str, every: float = 30.0) -> None:
        self.remote = remote.rstrip("/")
        self.fs, self.root = filesystem(remote)
        self.local = Path(tempfile.mkdtemp(prefix="torchherd-run-"))
        self.every = every
        self._last = 0.0

    def fetch(self, name: str) -> None:
        """Download ``name`` from the URL into the local folder, if it exists there."""
        try:
            self.fs.get_file(f"{self.root}/{name}", str(self.local / name))
        except FileNotFoundError:
            pass

    def upload(self, force: bool = False) -> None:
        """Upload every local file (when ``every`` seconds passed, or ``force``)."""
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return
        self._last = now
        for folder, _, files in os.walk(self.local):
            for file in files:
                path = Path(folder) / file
                relative = path.relative_to(self.local).as_posix()
                self.fs.put_file(str(path), f"{self.root}/{relative}")
