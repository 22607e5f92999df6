"""Durable file primitives for snapshots: fsync'd writes, atomic renames, streaming SHA-256.

Kept apart from the snapshot policy so the crash-safety rules live in one short place:
data is fsync'd before the rename that publishes it, and the parent directory is fsync'd after,
so a power cut or SIGKILL leaves either the old name or the complete new file, never a torn one.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Chunks at least this big are hashed on a helper thread while the main thread writes them:
# hashlib and write() both release the GIL, so a save costs max(hash, write) instead of the sum.
_PARALLEL_HASH_BYTES = 1 << 20
_READ_CHUNK = 8 << 20


class HashingWriter(io.RawIOBase):
    """A write-only file object that passes bytes to ``target`` and SHA-256s them on the way."""

    def __init__(self, target: io.BufferedWriter, pool: ThreadPoolExecutor) -> None:
        super().__init__()
        self._target = target
        self._pool = pool
        self._hash = hashlib.sha256()
        self.bytes_written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data)
        size = view.nbytes
        if size >= _PARALLEL_HASH_BYTES:
            hashing = self._pool.submit(self._hash.update, view)
            self._target.write(view)
            hashing.result()
        else:
            self._hash.update(view)
            self._target.write(view)
        self.bytes_written += size
        return size

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def write_durably(path: Path, produce: Callable[[io.RawIOBase], None]) -> tuple[str, int]:
    """Create ``path`` with the bytes ``produce`` writes, fsync it; return (sha256, size)."""
    with ThreadPoolExecutor(max_workers=1) as pool, open(path, "xb") as raw:
        writer = HashingWriter(raw, pool)
        produce(writer)
        raw.flush()
        os.fsync(raw.fileno())
    return writer.hexdigest(), writer.bytes_written


def sha256_of(path: Path) -> tuple[str, int]:
    """SHA-256 and size of a file, read in chunks so large snapshots need no extra memory."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_READ_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` survive a crash (POSIX needs the dir fsync'd)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_text(path: Path, text: str) -> None:
    """Atomically set the content of a small file (temporary name, fsync, rename, dir fsync)."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_tree(path: Path) -> None:
    """Delete a directory so that no half-deleted copy can be mistaken for a whole one.

    The rename to a hidden temporary name is atomic; only then are the files removed.
    """
    doomed = path.with_name(f".tmp-delete-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)
