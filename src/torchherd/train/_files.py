"""Durable file primitives for snapshots: fsync'd writes, atomic renames, chunked SHA-256.

Kept apart from the snapshot policy so the crash-safety rules live in one short place:
data is fsync'd before the rename that publishes it, and the parent directory is fsync'd after,
so a power cut or SIGKILL leaves either the old name or the complete new file, never a torn one.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import io
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

# Files are hashed as consecutive 8 MiB chunks, each with its own SHA-256, so that several
# cores can hash one file at once: a single SHA-256 stream runs at ~1 GB/s, slower than a disk
# write, and would be the bottleneck of every save and load.
CHUNK_BYTES = 8 << 20
_IN_FLIGHT = 4
# Copied bytes a HashingWriter lets wait for hashing before the writer waits too.
COPY_BUDGET = _IN_FLIGHT * CHUNK_BYTES

# The reader's chunk buffers outlive one load: allocating and first-touching 32 MiB costs more
# than hashing it on a fast machine. Kept per chunk size; at most _IN_FLIGHT of each are cached.
_spare_buffers: dict[int, list[bytearray]] = {}
_spare_lock = threading.Lock()


def _hash_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class _ChunkPipeline:
    """Hashes chunks read into buffers on worker threads, with at most _IN_FLIGHT in use."""

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


class StableMemory:
    """Address ranges that stay allocated and unchanged while one file is written and hashed.

    The snapshot's own tensors are such memory: the state is held by the caller for the whole
    save, and training waits (a sync save) or works on other memory (the host copy of an async
    save). Bytes written from inside these ranges can be hashed where they are, later, instead
    of being copied first: the copy was a third of a save's CPU time.
    """

    def __init__(self, spans: Iterable[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for address, size in sorted((a, a + n) for a, n in spans if n > 0):
            if merged and address <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], size)
            else:
                merged.append([address, size])
        self._starts = [start for start, _ in merged]
        self._ends = [end for _, end in merged]

    def holds(self, view: memoryview) -> bool:
        """True when all of ``view``'s bytes lie inside one of the ranges."""
        if not self._starts or view.nbytes == 0:
            return False
        address = _address_of(view)
        index = bisect.bisect_right(self._starts, address) - 1
        return index >= 0 and address + view.nbytes <= self._ends[index]


class _PyBuffer(ctypes.Structure):
    # CPython's Py_buffer, to read a read-only buffer's address (ctypes' from_buffer needs a
    # writable one, and the views torch.save writes are read-only).
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]


def _address_of(view: memoryview) -> int:
    buffer = _PyBuffer()
    if _get_buffer(view, ctypes.byref(buffer), 0) != 0:  # PyBUF_SIMPLE: contiguous bytes
        raise BufferError("cannot read the address of a buffer")
    try:
        return int(buffer.buf or 0)
    finally:
        _release_buffer(ctypes.byref(buffer))


class HashingWriter(io.RawIOBase):
    """A write-only file object that passes bytes to ``target`` and SHA-256s each chunk.

    Chunks are hashed on ``pool``'s threads while writing goes on. Bytes from ``stable``
    memory are hashed in place; others are copied first (the caller may reuse its buffer as
    soon as ``write`` returns), and at most COPY_BUDGET bytes of copies wait to be hashed.
    """

    def __init__(
        self,
        target: IO[bytes],
        pool: ThreadPoolExecutor,
        chunk_bytes: int = CHUNK_BYTES,
        stable: StableMemory | None = None,
    ) -> None:
        super().__init__()
        self._target = target
        self._pool = pool
        self._chunk_bytes = chunk_bytes
        self._stable = stable
        self._pieces: list[memoryview | bytearray] = []  # the chunk being filled
        self._copied = 0  # bytes of it that are copies
        self._fill = 0
        self._digests: list[Future[str]] = []
        self._copies_waiting = 0
        self._hashed = threading.Condition()
        self.bytes_written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        self._target.write(view)
        in_place = self._stable is not None and self._stable.holds(view)
        position, size = 0, view.nbytes
        while position < size:
            take = min(self._chunk_bytes - self._fill, size - position)
            piece = view[position : position + take]
            if in_place:
                self._pieces.append(piece)
            elif self._pieces and isinstance(self._pieces[-1], bytearray):
                self._pieces[-1] += piece  # small writes (headers) gather in one copy
                self._copied += take
            else:
                self._pieces.append(bytearray(piece))
                self._copied += take
            self._fill += take
            position += take
            if self._fill == self._chunk_bytes:
                self._submit()
        self.bytes_written += size
        return size

    def _submit(self) -> None:
        pieces, copied = self._pieces, self._copied
        self._pieces, self._copied, self._fill = [], 0, 0
        with self._hashed:  # bound the memory held by copies: wait for older chunks
            while self._copies_waiting and self._copies_waiting + copied > COPY_BUDGET:
                self._hashed.wait()
            self._copies_waiting += copied
        self._digests.append(self._pool.submit(self._hash, pieces, copied))

    def _hash(self, pieces: list[memoryview | bytearray], copied: int) -> str:
        try:
            digest = hashlib.sha256()
            for piece in pieces:
                digest.update(piece)
            return digest.hexdigest()
        finally:
            with self._hashed:
                self._copies_waiting -= copied
                self._hashed.notify_all()

    def chunk_digests(self) -> list[str]:
        """SHA-256 of each chunk, in order; call once, after the last write."""
        if self._fill or not self.bytes_written:
            self._submit()
        return [future.result() for future in self._digests]


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


def write_durably(
    path: Path, produce: Callable[[io.RawIOBase], object], stable: StableMemory | None = None
) -> Digest:
    """Create ``path`` with the bytes ``produce`` writes, fsync it, and return its digest.

    ``stable``: memory that ``produce`` writes from and that stays unchanged meanwhile.
    """
    with (
        ThreadPoolExecutor(_hash_workers()) as pool,
        ThreadPoolExecutor(1) as syncer,
        open(path, "xb") as raw,
    ):
        writer = HashingWriter(raw, pool, stable=stable)
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


def digest_stream(
    handle: IO[bytes], chunk_bytes: int = CHUNK_BYTES, copy_to: IO[bytes] | None = None
) -> Digest:
    """The chunked SHA-256 digest of everything left to read in ``handle``.

    ``copy_to``: also write the bytes there as they are read (a download kept on local disk:
    one pass over the network, and never more than a few chunks in memory).
    """
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
            if copy_to is not None and length:
                copy_to.write(memoryview(buffer)[:length])
            pipeline.submit(buffer, length)
            size += length
            if length < chunk_bytes:
                break
        return Digest(size, chunk_bytes, tuple(pipeline.digests()))


def digest_bytes(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> Digest:
    """The chunked SHA-256 digest of bytes already in memory (no copies; chunks in parallel)."""

    def chunk(start: int) -> str:
        with memoryview(data) as view, view[start : start + chunk_bytes] as piece:
            return hashlib.sha256(piece).hexdigest()

    with ThreadPoolExecutor(_hash_workers()) as pool:
        digests = tuple(pool.map(chunk, range(0, max(len(data), 1), chunk_bytes)))
    return Digest(len(data), chunk_bytes, digests)


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
