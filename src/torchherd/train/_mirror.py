"""A run directory at a URL: rank 0 writes into a local folder, a background thread uploads it.

``metrics.jsonl`` and TensorBoard's event files only grow, for days. Uploading every file whole
every interval would cost more each time, on the training thread; instead a thread of its own
uploads, every ``every`` seconds, only what changed:

- on S3, a file that grew is extended in place: one multipart upload whose first parts are
  copies of the object already there, made by the store itself (``UploadPartCopy``), and whose
  last part is the new bytes. A file below S3's 5 MiB part minimum is sent whole, so an upload
  costs at most 5 MiB plus the new bytes.
- elsewhere (``gs://``, ``memory://``...), a changed file is sent whole.

A file that was rewritten rather than extended (``metrics.jsonl`` after a resume drops the
steps about to be redone) is sent whole once. A failing store is reported once and retried at
the next interval; training never waits for it. ``close`` makes the last upload (bounded by a
deadline) and removes the local folder; a restarted job downloads ``metrics.jsonl`` first and
continues it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchherd.train._store import filesystem

__all__ = ["RunDirMirror"]

log = logging.getLogger("torchherd.train")

# S3's smallest part (all but the last part of a multipart upload), and its largest copy.
S3_MIN_PART = 5 << 20
S3_MAX_COPY = 4 << 30


@dataclass(slots=True)
class _Sent:
    """What the store holds of one local file: its first ``size`` bytes, from inode ``inode``."""

    inode: int
    size: int


class RunDirMirror:
    """Keeps ``local`` (a fresh temporary folder) and the URL ``remote`` in step."""

    def __init__(self, remote: str, every: float = 30.0) -> None:
        self.remote = remote.rstrip("/")
        self.fs, self.root = filesystem(remote)
        self.local = Path(tempfile.mkdtemp(prefix="torchherd-run-"))
        self.every = every
        self._sent: dict[str, _Sent] = {}
        self._lock = threading.Lock()  # one upload at a time (the thread's, or close's)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failing = False
        self._thread: threading.Thread | None = None
        self.uploads = 0
        """Upload rounds that sent something (for tests and curious people)."""
        self.bytes_sent = 0
        """Bytes sent over the network (server-side copies not counted)."""

    def fetch(self, name: str) -> None:
        """Download ``name`` from the URL into the local folder, if it exists there."""
        target = self.local / name
        try:
            self.fs.get_file(f"{self.root}/{name}", str(target))
        except FileNotFoundError:
            return
        stat = target.stat()
        self._sent[name] = _Sent(stat.st_ino, stat.st_size)  # the store already holds it

    def start(self) -> None:
        """Upload in the background from now on, every ``every`` seconds."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="run-dir-upload", daemon=True)
            self._thread.start()

    def nudge(self) -> None:
        """Upload soon, without waiting for the interval (a small file that must not be lost)."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.every)
            self._wake.clear()
            if not self._stop.is_set():
                self.upload()

    def upload(self) -> bool:
        """Send what changed since the last upload; False (reported once) when it failed."""
        with self._lock:
            try:
                self._upload_changed()
            except Exception as exc:  # noqa: BLE001 - a store outage must not stop training
                if not self._failing:
                    log.warning(
                        "cannot upload the run directory to %s (%s: %s); retrying every %.0fs, "
                        "training goes on",
                        self.remote,
                        exc.__class__.__name__,
                        exc,
                        self.every,
                    )
                self._failing = True
                return False
            if self._failing:
                log.warning("uploads to %s work again", self.remote)
                self._failing = False
            return True

    def _upload_changed(self) -> None:
        sent_any = False
        for folder, _, files in os.walk(self.local):
            for file in sorted(files):
                path = Path(folder) / file
                relative = path.relative_to(self.local).as_posix()
                stat = path.stat()
                before = self._sent.get(relative)
                if before is not None and (before.inode, before.size) == (
                    stat.st_ino,
                    stat.st_size,
                ):
                    continue
                grown = before is not None and before.inode == stat.st_ino
                old_size = before.size if grown and before is not None else 0
                self._send(path, f"{self.root}/{relative}", old_size, stat.st_size)
                self._sent[relative] = _Sent(stat.st_ino, stat.st_size)
                sent_any = True
        if sent_any:
            self.uploads += 1

    def _send(self, path: Path, target: str, old_size: int, size: int) -> None:
        if old_size >= S3_MIN_PART and size > old_size and _is_s3(self.fs):
            with open(path, "rb") as handle:
                handle.seek(old_size)
                new = handle.read(size - old_size)
            _s3_append(self.fs, target, old_size, new)
            self.bytes_sent += len(new)
            return
        with open(path, "rb") as handle:
            data = handle.read(size)  # what is there now; later bytes go next time
        self.fs.pipe_file(target, data)
        self.bytes_sent += len(data)

    def close(self, deadline: float = 60.0) -> bool:
        """Stop the thread, make the last upload (retried until ``deadline`` seconds), and
        remove the local folder; on failure keep it and say where it is. True when done."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=deadline)
        give_up = time.monotonic() + deadline
        while not self.upload():
            if time.monotonic() >= give_up:
                log.warning(
                    "the last upload to %s failed; the run's files are kept in %s",
                    self.remote,
                    self.local,
                )
                return False
            time.sleep(min(5.0, max(give_up - time.monotonic(), 0.0)))
        shutil.rmtree(self.local, ignore_errors=True)
        return True


def _is_s3(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    return "s3" in protocol and hasattr(fs, "call_s3")


def _s3_append(fs: Any, target: str, old_size: int, new: bytes) -> None:
    """Extend the object ``target`` (``old_size`` bytes, >= 5 MiB) with ``new``: the store
    copies what it has into the first parts, only ``new`` crosses the network."""
    bucket, key, _ = fs.split_path(target)
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
    try:
        parts = []
        pieces = -(-old_size // S3_MAX_COPY)
        bounds = [old_size * i // pieces for i in range(pieces + 1)]
        for number, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False), start=1):
            copied = fs.call_s3(
                "upload_part_copy",
                Bucket=bucket,
                Key=key,
                UploadId=upload,
                PartNumber=number,
                CopySource={"Bucket": bucket, "Key": key},
                CopySourceRange=f"bytes={start}-{end - 1}",
            )
            parts.append({"PartNumber": number, "ETag": copied["CopyPartResult"]["ETag"]})
        number = len(parts) + 1
        sent = fs.call_s3(
            "upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=new
        )
        parts.append({"PartNumber": number, "ETag": sent["ETag"]})
        fs.call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload,
            MultipartUpload={"Parts": parts},
        )
    except BaseException:
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
        except Exception:  # noqa: BLE001 - the original failure is the one to report
            pass
        raise
    fs.invalidate_cache(target)
