"""Where snapshots live: a local folder, or any fsspec URL (``s3://bucket/prefix``, ``memory://``).

Both stores keep the same promise, that a snapshot is complete or absent, by different means:

- ``LocalStore`` (a path, or ``file://``): the folder is written under a temporary name,
  fsynced and renamed (``_files.py``); a kill at any point leaves no ``step-N`` folder behind.
- ``RemoteStore`` (any other URL): object stores have no rename, so ``step-N/state.pt`` is
  uploaded first and ``step-N/manifest.json`` last: a ``step-N/`` without a manifest is an
  unfinished upload, ignored by readers and removed by the next save. Deleting goes the other
  way round (the manifest first), so a half-deleted snapshot is never taken for a whole one.

In both, the ``latest`` pointer (one small object, replaced whole) is written only after the
snapshot it names is complete. s3fs and fsspec are optional (``torchherd[s3]``) and imported
only when a URL is used; credentials come the way boto does it (``AWS_*`` variables, profiles,
``AWS_ENDPOINT_URL`` for S3-compatible stores), never from torchherd's own arguments.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from torchherd.train._files import (
    Digest,
    StableMemory,
    digest_bytes,
    digest_of,
    digest_stream,
    fsync_dir,
    remove_tree,
    replace_text,
    write_durably,
    write_small,
)
from torchherd.train.errors import SnapshotError

__all__ = [
    "SnapshotStore",
    "Prepared",
    "LocalStore",
    "RemoteStore",
    "open_store",
    "is_url",
    "filesystem",
]

LATEST = "latest"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d+)$")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# States up to this size are serialised in memory before the upload, larger ones to a local
# temporary file; those are uploaded in parts this big.
SPOOL_BYTES = 2 << 30
UPLOAD_PART_BYTES = 64 << 20
# Snapshots are downloaded in requests of this size, straight to a local file.
DOWNLOAD_BLOCK_BYTES = 32 << 20

Produce = Callable[[io.RawIOBase], object]


def is_url(location: str | os.PathLike[str]) -> bool:
    """True for ``scheme://...`` (``file://`` included); False for a plain path."""
    return isinstance(location, str) and bool(_URL.match(location))


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem for ``url`` and the path inside it; a clear error if missing."""
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError as exc:
        raise SnapshotError(
            f"{url} is a URL, and URLs need fsspec, which is not installed",
            remedy="pip install 'torchherd[s3]' (fsspec and s3fs), or use a local path",
        ) from exc
    del fsspec
    try:
        fs, path = url_to_fs(url)
    except ImportError as exc:
        scheme = url.split("://", 1)[0]
        extra = "s3" if scheme in ("s3", "s3a") else None
        remedy = (
            f"pip install 'torchherd[{extra}]'"
            if extra
            else f"install the fsspec package for {scheme}:// ({exc})"
        )
        raise SnapshotError(f"cannot open {url}: {exc}", remedy=remedy) from exc
    except ValueError as exc:
        raise SnapshotError(f"{url} is not a storage URL fsspec knows: {exc}") from exc
    return fs, path.rstrip("/")


class SnapshotStore(Protocol):
    """What the Snapshotter needs from a place that holds ``step-N`` snapshots."""

    location: str
    """The directory or URL, as shown to people."""
    remote: bool

    def names(self) -> list[str]:
        """Names of the complete-looking ``step-N`` entries (unordered)."""
        ...

    def read_latest(self) -> str | None:
        """The text of the ``latest`` pointer, or None when there is none."""
        ...

    def read_manifest(self, name: str) -> bytes:
        """``name/manifest.json``; FileNotFoundError when there is none."""
        ...

    def digest(self, name: str, file: str, chunk_bytes: int) -> Digest:
        """The digest of ``name/file`` as stored now, read as a stream; FileNotFoundError
        when missing."""
        ...

    def local_path(self, name: str, file: str) -> str | None:
        """``name/file`` as a local path (to memory-map it), or None for a remote store."""
        ...

    def download(self, name: str, file: str, target: Path, chunk_bytes: int) -> Digest:
        """Stream ``name/file`` into the local file ``target``; its digest on the way."""
        ...

    def write(
        self,
        name: str,
        file: str,
        produce: Produce,
        manifest: Callable[[Digest], bytes],
        stable: StableMemory | None = None,
    ) -> Digest:
        """Write ``name`` whole: ``file`` from ``produce``, then the manifest; publish it.

        ``stable``: memory ``produce`` writes from that stays unchanged until this returns.
        """
        ...

    def set_latest(self, name: str) -> None: ...

    def remove(self, name: str, background: bool) -> threading.Thread | None: ...

    def prepare(self, name: str, busy: bool) -> Prepared:
        """Before ``name`` is written: clear what killed saves and prunes left (``busy``: our
        own deletions may still be running), and list the complete snapshots present."""
        ...


@dataclass(frozen=True, slots=True)
class Prepared:
    """What a save starts from: one listing, so pruning after it needs no second one."""

    present: list[str]
    """Complete ``step-N`` snapshots other than the one being saved."""
    deleting: list[threading.Thread]
    """Background deletions of leftovers, started by ``prepare``."""


def open_store(location: str | os.PathLike[str]) -> SnapshotStore:
    """A local store for paths and ``file://`` URLs, a remote (fsspec) one for other URLs."""
    text = os.fspath(location)
    if is_url(text) and text.startswith("file://"):
        return LocalStore(Path(text[len("file://") :]))
    if is_url(text):
        return RemoteStore(text)
    return LocalStore(Path(text))


class LocalStore:
    """A folder on a local or mounted filesystem: temporary names, fsync and rename."""

    remote = False

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.location = str(directory)

    def names(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return [e.name for e in self.directory.iterdir() if STEP_DIR.match(e.name) and e.is_dir()]

    def read_latest(self) -> str | None:
        try:
            return (self.directory / LATEST).read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
            return None

    def read_manifest(self, name: str) -> bytes:
        return (self.directory / name / MANIFEST).read_bytes()

    def digest(self, name: str, file: str, chunk_bytes: int) -> Digest:
        return digest_of(self.directory / name / file, chunk_bytes)

    def local_path(self, name: str, file: str) -> str | None:
        return str(self.directory / name / file)

    def download(self, name: str, file: str, target: Path, chunk_bytes: int) -> Digest:
        with (
            open(self.directory / name / file, "rb", buffering=0) as source,
            open(target, "xb") as out,
        ):
            return digest_stream(source, chunk_bytes, copy_to=out)

    def write(
        self,
        name: str,
        file: str,
        produce: Produce,
        manifest: Callable[[Digest], bytes],
        stable: StableMemory | None = None,
    ) -> Digest:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".tmp-{name}-{os.getpid()}"
        tmp.mkdir()
        digest = write_durably(tmp / file, produce, stable)
        write_small(tmp / MANIFEST, manifest(digest))
        fsync_dir(tmp)
        final = self.directory / name
        if final.exists():  # the same step saved again (a rerun): the newer copy wins
            remove_tree(final)
        os.rename(tmp, final)
        fsync_dir(self.directory)
        return digest

    def set_latest(self, name: str) -> None:
        replace_text(self.directory / LATEST, name + "\n")

    def remove(self, name: str, background: bool) -> threading.Thread | None:
        return remove_tree(self.directory / name, background=background)

    def prepare(self, name: str, busy: bool) -> Prepared:
        # Temporary folders are left only by a save or a prune that was killed, or are being
        # deleted by this process's prune threads; this process is the directory's only
        # writer, so none of them can belong to a save in progress. An older copy of ``name``
        # itself is replaced by ``write``, atomically.
        threads: list[threading.Thread] = []
        if not self.directory.is_dir():
            return Prepared([], threads)
        for entry in self.directory.iterdir():
            if entry.name.startswith(".tmp-") and entry.is_dir():
                if entry.name.startswith(".tmp-delete-") and busy:
                    continue  # probably one of ours, still being deleted
                thread = remove_tree(entry, background=True)
                if thread is not None:
                    threads.append(thread)
            elif entry.name.startswith(".tmp-"):
                entry.unlink(missing_ok=True)
        return Prepared([n for n in self.names() if n != name], threads)


class RemoteStore:
    """A prefix in an object store or any fsspec filesystem: manifest last, pointer after."""

    remote = True

    def __init__(self, url: str) -> None:
        self.location = url.rstrip("/")
        self.fs, self.root = filesystem(url)
        self._memory = io.BytesIO()  # the last upload's bytes, overwritten by the next save

    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _keys(self) -> list[str]:
        # One recursive listing (a single request for up to 1000 objects on S3) instead of a
        # request per snapshot; another process (or node) may have written, so no cache.
        self.fs.invalidate_cache(self.root)
        try:
            found = self.fs.find(self.root, maxdepth=2)
        except FileNotFoundError:
            return []
        prefix = self.root + "/"
        return [key[len(prefix) :] for key in found if key.startswith(prefix)]

    def names(self) -> list[str]:
        return _complete(self._keys())

    def read_latest(self) -> str | None:
        try:
            return bytes(self.fs.cat_file(self._path(LATEST))).decode("utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            return None

    def read_manifest(self, name: str) -> bytes:
        return bytes(self.fs.cat_file(self._path(name, MANIFEST)))

    def digest(self, name: str, file: str, chunk_bytes: int) -> Digest:
        # Large blocks (few requests), no read-ahead cache: the object is never held whole.
        with self.fs.open(
            self._path(name, file), "rb", block_size=DOWNLOAD_BLOCK_BYTES, cache_type="none"
        ) as source:
            return digest_stream(source, chunk_bytes)

    def local_path(self, name: str, file: str) -> str | None:
        return None

    def download(self, name: str, file: str, target: Path, chunk_bytes: int) -> Digest:
        # One streamed GET straight to the file (ranged reads cost a request each, and some
        # servers read the whole object for every range); hashed from the page cache after.
        target.touch(exist_ok=False)
        self.fs.get_file(self._path(name, file), str(target))
        return digest_of(target, chunk_bytes)

    def write(
        self,
        name: str,
        file: str,
        produce: Produce,
        manifest: Callable[[Digest], bytes],
        stable: StableMemory | None = None,
    ) -> Digest:
        del stable  # hashed after serialising, from one buffer: nothing is copied for it
        # Serialised into memory (or a local spool file past SPOOL_BYTES) and uploaded in
        # one put. Streaming parts while torch.save runs was slower: every part is a request,
        # and the store reassembles the parts at the end. The bytes are hashed while they
        # upload (the upload mostly waits on the network), not while they are produced.
        target = self._path(name, file)
        spool = _UploadSpool(self._memory)
        try:
            produce(spool)
            payload = spool.finish()
            if payload is not None:
                with ThreadPoolExecutor(1) as hasher:
                    hashed = hasher.submit(digest_bytes, payload)
                    self.fs.pipe_file(target, payload)
                    digest = hashed.result()
            else:  # on disk: hash it, then stream it up in large parts
                assert spool.file is not None
                spool.file.seek(0)
                digest = digest_stream(spool.file)
                spool.file.seek(0)
                with self.fs.open(target, "wb", block_size=UPLOAD_PART_BYTES) as out:
                    shutil.copyfileobj(spool.file, out, UPLOAD_PART_BYTES)
        finally:
            spool.close()
        self.fs.pipe_file(self._path(name, MANIFEST), manifest(digest))
        return digest

    def set_latest(self, name: str) -> None:
        self.fs.pipe_file(self._path(LATEST), (name + "\n").encode())

    def _remove_now(self, name: str) -> None:
        try:
            self.fs.rm_file(self._path(name, MANIFEST))
        except FileNotFoundError:
            pass
        try:
            self.fs.rm(self._path(name), recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.root)

    def remove(self, name: str, background: bool) -> threading.Thread | None:
        # The manifest goes at once, so the snapshot stops counting before its data goes.
        try:
            self.fs.rm_file(self._path(name, MANIFEST))
        except FileNotFoundError:
            return None
        if not background:
            self._remove_now(name)
            return None
        thread = threading.Thread(
            target=self._remove_now, args=(name,), name="snapshot-prune", daemon=True
        )
        thread.start()
        return thread

    def prepare(self, name: str, busy: bool) -> Prepared:
        # One listing serves the whole save (each request costs a round trip to the store).
        keys = self._keys()
        complete = _complete(keys)
        entries = {key.split("/", 1)[0] for key in keys}
        unfinished = {n for n in entries if STEP_DIR.match(n) and n not in complete}
        if busy:
            unfinished = set()  # they may be our own prunes, still deleting
        if name in entries:
            # The same step saved again: unpublish the old copy before overwriting it.
            unfinished.add(name)
        for doomed in sorted(unfinished):
            self._remove_now(doomed)
        return Prepared([n for n in complete if n != name], [])


class _UploadSpool(io.RawIOBase):
    """Where a snapshot is serialised before its upload: a BytesIO kept from one save to the
    next, or a temporary file once the bytes pass SPOOL_BYTES.

    The BytesIO is reused because first-touching fresh memory cost more than serialising
    into it (a 64 MiB state: 45 ms into a new one, 9 ms into the last save's). Its bytes are
    handed to the upload without a copy; CPython copies them on the next write only if
    something still holds them then, so a save never changes bytes another one uses.
    """

    def __init__(self, memory: io.BytesIO) -> None:
        super().__init__()
        memory.seek(0)
        self.memory = memory
        self.size = 0
        self.file: IO[bytes] | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        if self.file is None and self.size + view.nbytes > SPOOL_BYTES:
            self.file = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
            self.file.write(self.memory.getvalue()[: self.size])
            self.memory.seek(0)
            self.memory.truncate()  # too big to keep around
        (self.file or self.memory).write(view)
        self.size += view.nbytes
        return view.nbytes

    def finish(self) -> bytes | None:
        """The serialised bytes (shared with the BytesIO), or None when they went to ``file``."""
        if self.file is not None:
            return None
        self.memory.truncate(self.size)  # what a larger previous snapshot left at the end
        return self.memory.getvalue()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        super().close()


def _complete(keys: list[str]) -> list[str]:
    """The ``step-N`` entries among ``keys`` (relative to the root) that have a manifest."""
    return [
        key.split("/", 1)[0]
        for key in keys
        if key.endswith("/" + MANIFEST) and STEP_DIR.match(key.split("/", 1)[0])
    ]
