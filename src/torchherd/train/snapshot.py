"""Atomic, verifiable snapshots in ``step-N`` folders, with a ``latest`` pointer and pruning.

Layout of a snapshot directory::

    latest                 one line, "step-N": only ever names a complete snapshot
    step-N/state.pt        torch.save of the state (loaded back with weights_only=True)
    step-N/manifest.json   format, step, and the size and SHA-256 digests of every file

A save writes ``.tmp-step-N-*``, fsyncs every file and the folder, renames it to ``step-N``,
then moves ``latest``. A crash at any point leaves the previous snapshot named by ``latest``.
A load verifies the manifest before unpickling and refuses anything but tensors and plain
data; a damaged or unsafe snapshot is reported and the one before it is used.

With ``scope="shared"`` the directory is on a filesystem every node sees, and global rank 0
writes it once. With ``scope="node"`` each node keeps its own copy on a local disk, written by
its local rank 0. Loading agrees across ranks on one step that every rank can read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, cast

import torch
import torch.distributed as dist

from torchherd.train._files import (
    digest_of,
    fsync_dir,
    remove_tree,
    replace_text,
    write_durably,
    write_small,
)
from torchherd.train.dist import Context, current_context
from torchherd.train.errors import SnapshotCorrupt, SnapshotError

__all__ = ["Snapshotter", "SnapshotProblem", "Scope"]

log = logging.getLogger("torchherd.train")

Scope = Literal["shared", "node"]
FORMAT = 1
LATEST = "latest"
MANIFEST = "manifest.json"
STATE_FILE = "state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True, slots=True)
class SnapshotProblem:
    """One snapshot that could not be used, and why (shown to people, kept for callers)."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class Snapshotter:
    """Saves and restores training state as ``step-N`` snapshots under one directory."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep: int | None = 3,
        scope: Scope = "shared",
        ctx: Context | None = None,
    ) -> None:
        if keep is not None and keep < 1:
            raise SnapshotError(
                f"keep={keep} would delete every snapshot", "use keep >= 1, or None to keep all"
            )
        if scope not in ("shared", "node"):
            raise SnapshotError(f"unknown snapshot scope {scope!r}", "use 'shared' or 'node'")
        self.directory = Path(directory)
        self.keep = keep
        self.scope: Scope = scope
        self.ctx = ctx if ctx is not None else current_context()
        self.problems: list[SnapshotProblem] = []
        """Snapshots the last ``load_latest`` had to skip, newest first."""
        self._deleting: list[threading.Thread] = []

    # ----------------------------------------------------------------------------- saving

    @property
    def is_writer(self) -> bool:
        """True on the rank that writes this directory: global rank 0, or local rank 0 per node."""
        return self.ctx.is_main if self.scope == "shared" else self.ctx.is_local_main

    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> Path | None:
        """Write ``state`` as snapshot ``step`` (on writer ranks; others return None at once).

        ``state`` may hold tensors, numbers, strings, None, and lists/tuples/dicts of them:
        what ``torch.load(weights_only=True)`` accepts. ``meta`` (JSON-able) goes to the manifest.
        """
        if step < 0:
            raise SnapshotError(f"snapshot step must be >= 0, got {step}")
        if not self.is_writer:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        name = f"step-{step}"
        tmp = self.directory / f".tmp-{name}-{os.getpid()}"
        tmp.mkdir()
        started = time.perf_counter()
        with _without_crc32():
            digest = write_durably(
                tmp / STATE_FILE, lambda f: torch.save(state, cast(IO[bytes], f))
            )
        manifest = {
            "format": FORMAT,
            "step": step,
            "created_unix": time.time(),
            "world_size": self.ctx.world_size,
            "torch": torch.__version__,
            "files": {STATE_FILE: digest.to_json()},
            "meta": meta or {},
        }
        write_small(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        fsync_dir(tmp)
        final = self.directory / name
        if final.exists():  # the same step saved again (a rerun): the newer copy wins
            remove_tree(final)
        os.rename(tmp, final)
        fsync_dir(self.directory)
        replace_text(self.directory / LATEST, name + "\n")
        self._prune(keep_name=name)
        log.debug("saved %s (%d bytes) in %.2fs", final, digest.size, time.perf_counter() - started)
        return final

    def _remove_leftovers(self) -> None:
        # Temporary folders are left only by a save or a prune that was killed, or are being
        # deleted by this process's prune threads; this process is the directory's only
        # writer, so none of them can belong to a save in progress.
        for entry in self.directory.iterdir():
            if entry.name.startswith(".tmp-") and entry.is_dir():
                if entry.name.startswith(".tmp-delete-") and self._deleting:
                    continue  # probably one of ours, still being deleted
                self._forget(remove_tree(entry, background=True))
            elif entry.name.startswith(".tmp-"):
                entry.unlink(missing_ok=True)

    def _prune(self, keep_name: str) -> None:
        if self.keep is None:
            return
        steps = self.steps()
        for step in steps[self.keep :]:
            if f"step-{step}" != keep_name:
                self._forget(remove_tree(self.directory / f"step-{step}", background=True))

    def _forget(self, thread: threading.Thread | None) -> None:
        self._deleting = [t for t in self._deleting if t.is_alive()]
        if thread is not None:
            self._deleting.append(thread)

    def close(self) -> None:
        """Wait until pruned snapshots are deleted (they are removed on background threads)."""
        for thread in self._deleting:
            thread.join()
        self._deleting = []

    # ----------------------------------------------------------------------------- loading

    def steps(self) -> list[int]:
        """Steps of the ``step-N`` folders present (complete by construction), newest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                found.append(int(match.group(1)))
        return sorted(found, reverse=True)

    def latest_step(self) -> int | None:
        """The step ``latest`` names, or None when there is no readable pointer."""
        try:
            text = (self.directory / LATEST).read_text(encoding="utf-8").strip()
        except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
            return None
        match = _STEP_DIR.match(text)
        return int(match.group(1)) if match else None

    def _candidates(self) -> list[int]:
        # Trust the pointer first; snapshots newer than it were never published (the save died
        # between rename and pointer update), so they are ignored. Without a pointer, scan.
        steps = self.steps()
        pointed = self.latest_step()
        if pointed is None or pointed not in steps:
            return steps
        return [s for s in steps if s <= pointed]

    def verify(self, step: int) -> str | None:
        """Check snapshot ``step`` against its manifest; return why it is unusable, or None."""
        folder = self.directory / f"step-{step}"
        try:
            manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
            files = manifest["files"]
            header = (manifest.get("format"), manifest.get("step"))
            if header != (FORMAT, step):
                return f"manifest is for format {header[0]} step {header[1]}"
        except FileNotFoundError:
            return "no manifest.json (incomplete or not a torchherd snapshot)"
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            return f"manifest.json is unreadable ({exc.__class__.__name__}: {exc})"
        if not isinstance(files, dict) or STATE_FILE not in files:
            return f"manifest does not list {STATE_FILE}"
        for name, expected in files.items():
            try:
                size = int(expected["bytes"])
                digest = digest_of(folder / name, int(expected["chunk_bytes"]))
            except FileNotFoundError:
                return f"{name} is missing"
            except (KeyError, TypeError, ValueError):
                return f"manifest entry for {name} is malformed"
            if digest.size != size:
                hint = " (truncated)" if digest.size < size else ""
                return f"{name} is {digest.size} bytes, manifest says {size}{hint}"
            if list(digest.sha256_chunks) != expected.get("sha256_chunks"):
                return f"{name} fails its SHA-256 check (flipped or overwritten bytes)"
        return None

    def _read(self, step: int) -> tuple[Any, str | None]:
        reason = self.verify(step)
        if reason is not None:
            return None, reason
        path = self.directory / f"step-{step}" / STATE_FILE
        try:
            return torch.load(path, map_location="cpu", weights_only=True), None
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return None, (
                "refused as unsafe: it holds objects other than tensors and plain data, "
                f"which weights_only=True loading does not run ({first})"
            )
        except Exception as exc:  # noqa: BLE001 - any failure to read means "unusable"
            return None, f"cannot be read ({exc.__class__.__name__}: {exc})"

    def load_latest(self) -> tuple[int, Any] | None:
        """Return ``(step, state)`` of the newest usable snapshot, or None when there is none.

        A damaged or unsafe snapshot is logged and the previous one tried; if snapshots exist
        but none is usable, ``SnapshotCorrupt`` is raised rather than silently starting over.
        Collective when a process group exists: every rank must call it, and all get one step.
        """
        self.problems = []
        candidates = self._agree_on_candidates(self._candidates())
        for step in candidates:
            state, reason = self._read(step)
            if self._all_ranks_ok(reason is None):
                if self.problems and self._reports():
                    log.warning("resuming from %s instead", self.directory / f"step-{step}")
                return step, state
            problem = SnapshotProblem(
                self.directory / f"step-{step}", reason or "unreadable on another rank"
            )
            self.problems.append(problem)
            if self._reports():
                log.warning("snapshot %s is unusable: %s", problem.path, problem.reason)
        if not self.problems:
            return None
        listing = "\n".join(f"  {p}" for p in self.problems)
        raise SnapshotCorrupt(
            f"no usable snapshot in {self.directory}; every one was refused:\n{listing}",
            remedy=(
                f"move {self.directory} aside to start from scratch, "
                "or restore a good snapshot into it"
            ),
            problems=tuple(str(p) for p in self.problems),
        )

    def _reports(self) -> bool:
        # One line per copy of the directory, not one per rank.
        return self.is_writer

    def _agree_on_candidates(self, mine: list[int]) -> list[int]:
        if not self.ctx.distributed:
            return mine
        everyone: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        lists = [entry or [] for entry in everyone]
        if self.scope == "shared" and any(entry != lists[0] for entry in lists):
            differing = [rank for rank, entry in enumerate(lists) if entry != lists[0]]
            raise SnapshotError(
                f"ranks see different snapshots in {self.directory} "
                f"(rank 0: {lists[0][:3]}, ranks {differing[:8]} differ): it is not shared",
                remedy="put the snapshots on a filesystem every node mounts, or use scope='node'",
            )
        common = set(lists[0]).intersection(*map(set, lists[1:]))
        return sorted(common, reverse=True)

    def _all_ranks_ok(self, ok: bool) -> bool:
        if not self.ctx.distributed:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self._collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _collective_device(self) -> torch.device:
        return self.ctx.device if dist.get_backend() == "nccl" else torch.device("cpu")


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    # torch.save's zip writer CRC32s every record, a full extra pass over the data; the
    # manifest's SHA-256 already guards the file, so skip it (torch.load does not need it).
    # Process-wide setting, restored at once; torch < 2.6 has no switch and keeps its CRC.
    get = getattr(torch.serialization, "get_crc32_options", None)
    put = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or put is None:
        yield
        return
    before = get()
    put(False)
    try:
        yield
    finally:
        put(before)
