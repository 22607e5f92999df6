"""Durable file primitives for snapshots: fsync'd writes, atomic renames, chunked SHA-256.

Kept apart from the snapshot policy so the crash-safety rules live in one short place:
data is fsync'd before the rename that publishes it, and the parent directory is fsync'd after,
so a power cut or SIGKILL leaves either the old name or the complete new file, never a torn one.
"""

from __future__ import annotations

import hashlib
import io
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

# Files are hashed as consecutive 8 MiB chunks, each with its own SHA-256, so that several
# cores can hash one file at once: a single SHA-256 stream runs at ~1 GB/s, slower than a disk
# write, and would be the bottleneck of every save and load.
CHUNK_BYTES = 8 << 20
_IN_FLIGHT = 4

# Chunk buffers outlive one save: allocating and first-touching 32 MiB costs more than
# hashing it on a fast machine. Kept per chunk size; at most _IN_FLIGHT of each are cached.
_spare_buffers: dict[int, list[bytearray]] = {}
_spare_lock = threading.Lock()


def _hash_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class _ChunkPipeline:
    """Hashes chunks on worker threads, with at most _IN_FLIGHT buffers in use at once."""

    def __init__(self, pool: ThreadPoolExecutor, chunk_bytes: int) -> None:
        self._pool = pool
        self._chunk_bytes = chunk_bytes
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        with _spare_lock:
            self._owned = _spare_buffers.pop(chunk_bytes, [])
        for buffer in self._owned:
            self._free.put(buffer)
        self._digests: list[Future[str]] = []

    def take(self) -> bytearray:
        """A free buffer; blocks while every buffer is being hashed (bounds the memory)."""
        if self._free.empty() and len(self._owned) < _IN_FLIGHT:
            self._owned.append(bytearray(self._chunk_bytes))
            return self._owned[-1]
        return self._free.get()

    def submit(self, buffer: bytearray, length: int) -> None:
        self._digests.append(self._pool.submit(self._hash, buffer, length))

    def _hash(self, buffer: bytearray, length: int) -> str:
        digest = hashlib.sha256(memoryview(buffer)[:length]).hexdigest()
        self._free.put(buffer)
        return digest

    def digests(self) -> list[str]:
        """Wait for every chunk's digest; the buffers go back to the shared spares."""
        found = [future.result() for future in self._digests]
        with _spare_lock:
            _spare_buffers[self._chunk_bytes] = self._owned
        self._owned = []
        return found


class HashingWriter(io.RawIOBase):
    """A write-only file object that passes bytes to ``target`` and SHA-256s each chunk."""

    def __init__(
        self, target: IO[bytes], pool: ThreadPoolExecutor, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        super().__init__()
        self._target = target
        self._chunk_bytes = chunk_bytes
        self._pipeline = _ChunkPipeline(pool, chunk_bytes)
        self._buffer = self._pipeline.take()
        self._fill = 0
        self.bytes_written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        self._target.write(view)
        # The caller may reuse its buffer as soon as we return, so hashing works on a copy.
        position, size = 0, view.nbytes
        while position < size:
            take = min(self._chunk_bytes - self._fill, size - position)
            self._buffer[self._fill : self._fill + take] = view[position : position + take]
            self._fill += take
            position += take
            if self._fill == self._chunk_bytes:
                self._pipeline.submit(self._buffer, self._fill)
                self._buffer, self._fill = self._pipeline.take(), 0
        self.bytes_written += size
        return size

    def chunk_digests(self) -> list[str]:
        """SHA-256 of each chunk, in order; call once, after the last write."""
        if self._fill or not self.bytes_written:
            self._pipeline.submit(self._buffer, self._fill)
            self._fill = 0
        return self._pipeline.digests()


@dataclass(frozen=True, slots=True)
class Digest:
    """What the manifest records of one file."""

    size: int
    chunk_bytes: int
    sha256_chunks: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.size,
            "chunk_bytes": self.chunk_bytes,
            "sha256_chunks": list(self.sha256_chunks),
        }


def write_durably(path: Path, produce: Callable[[io.RawIOBase], object]) -> Digest:
    """Create ``path`` with the bytes ``produce`` writes, fsync it, and return its digest."""
    with (
        ThreadPoolExecutor(_hash_workers()) as pool,
        ThreadPoolExecutor(1) as syncer,
        open(path, "xb") as raw,
    ):
        writer = HashingWriter(raw, pool)
        produce(writer)
        raw.flush()
        # The disk flush and the last chunks' hashing overlap; both must finish to return.
        synced = syncer.submit(os.fsync, raw.fileno())
        digests = writer.chunk_digests()
        synced.result()
    return Digest(writer.bytes_written, CHUNK_BYTES, tuple(digests))


def write_small(path: Path, data: bytes) -> None:
    """Create ``path`` holding ``data`` (a manifest: small, needs no digest), fsync'd."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def digest_of(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Digest:
    """The chunked SHA-256 digest of an existing file (reads sequentially, hashes in parallel)."""
    with open(path, "rb", buffering=0) as handle:
        return digest_stream(handle, chunk_bytes)


def digest_stream(handle: IO[bytes], chunk_bytes: int = CHUNK_BYTES) -> Digest:
    """The chunked SHA-256 digest of everything left to read in ``handle``."""
    size = 0
    with ThreadPoolExecutor(_hash_workers()) as pool:
        pipeline = _ChunkPipeline(pool, chunk_bytes)
        while True:
            buffer = pipeline.take()
            length = handle.readinto(buffer) or 0  # type: ignore[attr-defined]
            # Fill the buffer completely: chunk boundaries must match the writer's.
            while 0 < length < chunk_bytes:
                more = handle.readinto(memoryview(buffer)[length:]) or 0  # type: ignore[attr-defined]
                if not more:
                    break
                length += more
            if length == 0 and size:
                break
            pipeline.submit(buffer, length)
            size += length
            if length < chunk_bytes:
                break
        return Digest(size, chunk_bytes, tuple(pipeline.digests()))


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


def remove_tree(path: Path, background: bool = False) -> threading.Thread | None:
    """Delete a directory so that no half-deleted copy can be mistaken for a whole one.

    The rename to a hidden temporary name is atomic; only then are the files removed, on a
    daemon thread (returned) when ``background``: unlinking gigabytes takes a while, and a
    leftover from an exit in between is a ``.tmp-`` folder, which the next save clears.
    """
    doomed = path
    if not path.name.startswith(".tmp-"):
        doomed = path.with_name(f".tmp-delete-{path.name}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return None
    if not background:
        shutil.rmtree(doomed, ignore_errors=True)
        return None
    thread = threading.Thread(
        target=shutil.rmtree, args=(doomed, True), name="snapshot-prune", daemon=True
    )
    thread.start()
    return thread
