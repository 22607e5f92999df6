"""Atomic, verifiable snapshots in ``step-N`` folders, with a ``latest`` pointer and pruning.

Layout of a snapshot directory::

    latest                 one line, "step-N": only ever names a complete snapshot
    step-N/state.pt        torch.save of the state (loaded back with weights_only=True)
    step-N/manifest.json   format, step, and the size and SHA-256 digests of every file

The directory is a path or any fsspec URL (``s3://bucket/prefix``); ``_store.py`` says how
each kind is committed so that a snapshot is complete or absent. A crash at any point leaves
the previous snapshot named by ``latest``. A load verifies sizes and SHA-256 digests against
the manifest before unpickling and refuses anything but tensors and plain data; a damaged or
unsafe snapshot is reported and the one before it is used.

``save`` writes before it returns. ``save_async`` stalls the caller only while the state is
copied to host memory; serialising, hashing, writing and committing run on a background
thread, one save at a time (the next save, ``wait`` and ``close`` wait for it). A save still
running when the process gets SIGTERM is finished before the signal takes effect, and a
normal exit waits for it too.

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
import secrets
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any, Literal, cast

import torch
import torch.distributed as dist

from torchherd import progress
from torchherd.train._files import Digest, StableMemory
from torchherd.train._staging import HostStager, host_storage_spans
from torchherd.train._store import STEP_DIR, is_url, open_store
from torchherd.train.dist import Context, current_context
from torchherd.train.errors import SnapshotCorrupt, SnapshotError

__all__ = ["Snapshotter", "SnapshotProblem", "Scope"]

log = logging.getLogger("torchherd.train")

Scope = Literal["shared", "node"]
FORMAT = 1
STATE_FILE = "state.pt"
_STEP_DIR = STEP_DIR
# A shared directory listed differently by the ranks is listed again, RELIST_TRIES times in
# all, RELIST_WAIT s apart, before it is called not shared.
RELIST_TRIES = 4
RELIST_WAIT = 0.5


@dataclass(frozen=True, slots=True)
class SnapshotProblem:
    """One snapshot that could not be used, and why (shown to people, kept for callers)."""

    path: Path | str
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
        if (
            scope == "node"
            and is_url(os.fspath(directory))
            and not str(directory).startswith("file://")
        ):
            raise SnapshotError(
                f"scope='node' keeps one copy per node on local disks; {directory} is remote",
                remedy="use scope='shared' for a URL (every node reaches it), or a local path",
            )
        self.store = open_store(directory)
        self.directory: Path | str = (
            Path(self.store.location) if not self.store.remote else self.store.location
        )
        self.keep = keep
        self.scope: Scope = scope
        self.ctx = ctx if ctx is not None else current_context()
        self.problems: list[SnapshotProblem] = []
        """Snapshots the last ``load_latest`` had to skip, newest first."""
        self._deleting: list[threading.Thread] = []
        self._stager = HostStager()
        self._in_flight: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._sigterm_before: Any = None

    # ----------------------------------------------------------------------------- saving

    @property
    def is_writer(self) -> bool:
        """True on the rank that writes this directory: global rank 0, or local rank 0 per node."""
        return self.ctx.is_main if self.scope == "shared" else self.ctx.is_local_main

    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> Path | str | None:
        """Write ``state`` as snapshot ``step`` before returning (on writer ranks; others
        return None at once). Returns where it went.

        ``state`` may hold tensors, numbers, strings, None, and lists/tuples/dicts of them:
        what ``torch.load(weights_only=True)`` accepts. ``meta`` (JSON-able) goes to the manifest.
        Its tensors must not change until this returns (another thread's update would make
        the file mix old and new values, and fail its digest check on load).
        """
        if step < 0:
            raise SnapshotError(f"snapshot step must be >= 0, got {step}")
        if not self.is_writer:
            return None
        with progress.phase("saving snapshot"):
            self.wait()
            return self._commit(step, state, meta, prune_in_background=True)

    def save_async(
        self,
        step: int,
        state: Any,
        meta: dict[str, Any] | None = None,
        on_saved: Callable[[Path | str], None] | None = None,
    ) -> bool:
        """Copy ``state`` to host memory and write it as snapshot ``step`` in the background.

        Returns once the copy is made (True), or at once on ranks that do not write (False).
        A save still in flight is waited for first. ``on_saved(location)`` runs on the
        background thread once the snapshot is committed. A failure of the background write
        is raised by the next ``save``/``save_async``/``wait``/``close``.
        """
        if step < 0:
            raise SnapshotError(f"snapshot step must be >= 0, got {step}")
        if not self.is_writer:
            return False
        self.wait()
        with progress.phase("copying snapshot to host memory"):
            staged = self._stager.stage(state)
        self._finish_on_sigterm()
        _finish_before_pools_close(self)
        thread = threading.Thread(
            target=self._commit_in_background,
            args=(step, staged, meta, on_saved),
            name=f"snapshot-step-{step}",
            daemon=False,  # a normal exit waits for the save to be committed
        )
        self._in_flight = thread
        thread.start()
        return True

    @property
    def saving(self) -> bool:
        """True while a background save is running."""
        return self._in_flight is not None and self._in_flight.is_alive()

    def wait(self) -> None:
        """Wait for the background save, if any; raise its error if it failed."""
        thread, self._in_flight = self._in_flight, None
        if thread is not None and thread.is_alive():
            with progress.phase("waiting for a background snapshot save"):
                thread.join()
        failure, self._failure = self._failure, None
        if failure is not None:
            if isinstance(failure, SnapshotError):
                raise failure
            raise SnapshotError(
                f"a background snapshot save to {self.directory} failed: "
                f"{failure.__class__.__name__}: {failure}",
                remedy="check the storage (space, permissions, credentials); "
                "the previous snapshot is intact",
            ) from failure

    def _commit_in_background(
        self,
        step: int,
        state: Any,
        meta: dict[str, Any] | None,
        on_saved: Callable[[Path | str], None] | None,
    ) -> None:
        try:
            # Pruning is part of the save here: this thread is off the training path, and a
            # deletion left running would compete with the next save's copy to host memory.
            where = self._commit(step, state, meta, prune_in_background=False)
            if on_saved is not None:
                on_saved(where)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._failure = exc

    def _commit(
        self, step: int, state: Any, meta: dict[str, Any] | None, prune_in_background: bool
    ) -> Path | str:
        name = f"step-{step}"
        prepared = self.store.prepare(name, busy=bool(self._alive_deletions()))
        self._forget_many(prepared.deleting)
        started = time.perf_counter()

        def manifest(digest: Any) -> bytes:
            return json.dumps(
                {
                    "format": FORMAT,
                    "step": step,
                    "created_unix": time.time(),
                    "world_size": self.ctx.world_size,
                    "torch": torch.__version__,
                    "files": {STATE_FILE: digest.to_json()},
                    "meta": meta or {},
                },
                indent=1,
            ).encode()

        with _without_crc32():
            digest = self.store.write(
                name,
                STATE_FILE,
                lambda f: torch.save(state, cast(IO[bytes], f)),
                manifest,
                StableMemory(host_storage_spans(state)),
            )
        self.store.set_latest(name)
        where = self._location(name)
        progress.saved(step, str(where))  # committed: a time-limit stop may now end as saved
        self._prune(name, prepared.present, prune_in_background)
        log.debug("saved %s (%d bytes) in %.2fs", where, digest.size, time.perf_counter() - started)
        return where

    def _location(self, name: str) -> Path | str:
        if isinstance(self.directory, Path):
            return self.directory / name
        return f"{self.directory}/{name}"

    def _join_in_flight(self) -> None:
        thread = self._in_flight
        if thread is not None and thread.is_alive():
            thread.join()
        if self._failure is not None:  # nobody is left to raise it to
            log.error("the background snapshot save failed at exit: %s", self._failure)

    def _finish_on_sigterm(self) -> None:
        # SIGTERM (torchrun's and herd's stop) would end the process mid-write; finish the
        # save first, then let the signal do what it did before. Only the main thread may
        # install handlers; elsewhere a normal exit still waits (the thread is not a daemon).
        if (
            self._sigterm_before is not None
            or threading.current_thread() is not threading.main_thread()
        ):
            return
        self._sigterm_before = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self.saving:
            log.warning("SIGTERM: finishing the snapshot being written first")
            thread = self._in_flight
            if thread is not None:
                thread.join()
        before, self._sigterm_before = self._sigterm_before, None
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
        if callable(before):
            before(signum, frame)
        elif before != signal.SIG_IGN:
            os.kill(os.getpid(), signum)

    def _restore_sigterm(self) -> None:
        if self._sigterm_before is None:
            return
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm_before)
            self._sigterm_before = None

    def _prune(self, saved: str, present: list[str], background: bool) -> None:
        # ``present`` was listed when this save began; this process is the only writer.
        if self.keep is None:
            return
        steps = sorted((_step_of(n) for n in {*present, saved}), reverse=True)
        for step in steps[self.keep :]:
            if f"step-{step}" != saved:
                self._forget(self.store.remove(f"step-{step}", background=background))

    def _alive_deletions(self) -> list[threading.Thread]:
        self._deleting = [t for t in self._deleting if t.is_alive()]
        return self._deleting

    def _forget(self, thread: threading.Thread | None) -> None:
        self._alive_deletions()
        if thread is not None:
            self._deleting.append(thread)

    def _forget_many(self, threads: list[threading.Thread]) -> None:
        for thread in threads:
            self._forget(thread)

    def close(self) -> None:
        """Wait for a background save, and until pruned snapshots are deleted."""
        try:
            self.wait()
        finally:
            if any(thread.is_alive() for thread in self._deleting):
                with progress.phase("deleting pruned snapshots"):
                    for thread in list(self._deleting):
                        thread.join()
            self._deleting = []
            self._restore_sigterm()

    # ----------------------------------------------------------------------------- loading

    def steps(self) -> list[int]:
        """Steps of the complete ``step-N`` snapshots present, newest first."""
        return sorted(map(_step_of, self.store.names()), reverse=True)

    def latest_step(self) -> int | None:
        """The step ``latest`` names, or None when there is no readable pointer."""
        text = self.store.read_latest()
        match = _STEP_DIR.match(text.strip()) if text is not None else None
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
        """Check snapshot ``step`` against its manifest; return why it is unusable, or None.

        Reads the stored file once, as a stream (a remote object is never held in memory).
        """
        name = f"step-{step}"
        return self._check(step, lambda file, chunk: self.store.digest(name, file, chunk))

    def _manifest_files(self, step: int) -> tuple[dict[str, Any], str | None]:
        try:
            manifest = json.loads(self.store.read_manifest(f"step-{step}").decode("utf-8"))
            files = manifest["files"]
            header = (manifest.get("format"), manifest.get("step"))
            if header != (FORMAT, step):
                return {}, f"manifest is for format {header[0]} step {header[1]}"
        except FileNotFoundError:
            return {}, "no manifest.json (incomplete or not a torchherd snapshot)"
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            return {}, f"manifest.json is unreadable ({exc.__class__.__name__}: {exc})"
        if not isinstance(files, dict) or STATE_FILE not in files:
            return {}, f"manifest does not list {STATE_FILE}"
        return files, None

    def _check(self, step: int, digest_of: Callable[[str, int], Digest]) -> str | None:
        """Why snapshot ``step`` is unusable (its manifest, then each file's size and
        digests, as ``digest_of(file, chunk_bytes)`` reads them), or None."""
        files, reason = self._manifest_files(step)
        if reason is not None:
            return reason
        for file, expected in files.items():
            try:
                size = int(expected["bytes"])
                digest = digest_of(file, int(expected["chunk_bytes"]))
            except FileNotFoundError:
                return f"{file} is missing"
            except (KeyError, TypeError, ValueError):
                return f"manifest entry for {file} is malformed"
            if digest.size != size:
                hint = " (truncated)" if digest.size < size else ""
                return f"{file} is {digest.size} bytes, manifest says {size}{hint}"
            if list(digest.sha256_chunks) != expected.get("sha256_chunks"):
                return f"{file} fails its SHA-256 check (flipped or overwritten bytes)"
        return None

    def _read(self, step: int, spool: _NodeSpool | None = None) -> tuple[Any, str | None]:
        """Verify snapshot ``step`` once per stored copy and load it on every rank.

        Local files are checked by the rank that writes them (global rank 0, or local rank
        0 per node) and memory-mapped by every rank: the ranks of a node share one copy in
        the page cache instead of each holding its own. A remote object is streamed to a
        node-local file by local rank 0 of each node, checked on the way, and mapped the
        same way. The verdict is shared, so every rank gets the same step or none.
        """
        if spool is None:  # one snapshot alone: a spool of its own
            with _NodeSpool(self.ctx, secrets.token_hex(4), self.store.remote) as own:
                found = self._read(step, own)
                self._all_ranks_ok(True)  # every rank has mapped it
                own.discard(step)
                return found
        name = f"step-{step}"
        local = self.store.local_path(name, STATE_FILE)
        reason: str | None = None
        try:
            if local is None and self.ctx.is_local_main:
                target = spool.path(step)
                reason = self._check(
                    step, lambda file, chunk: self.store.download(name, file, target, chunk)
                )
            elif local is not None and self.is_writer:
                reason = self.verify(step)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait for this verdict
            reason = f"cannot be read ({exc.__class__.__name__}: {exc})"
        reason = self._shared_reason(reason)
        if reason is not None:
            return None, reason
        path = local if local is not None else str(spool.path(step))
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True), None
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return None, (
                "refused as unsafe: it holds objects other than tensors and plain data, "
                f"which weights_only=True loading does not run ({first})"
            )
        except Exception as exc:  # noqa: BLE001 - any failure to read means "unusable"
            return None, f"cannot be read ({exc.__class__.__name__}: {exc})"

    def _shared_reason(self, mine: str | None) -> str | None:
        """The first verifying rank's reason, on every rank (one small collective)."""
        if not self.ctx.distributed:
            return mine
        everyone: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return next((reason for reason in everyone if reason is not None), None)

    def load_latest(self) -> tuple[int, Any] | None:
        """Return ``(step, state)`` of the newest usable snapshot, or None when there is none.

        A damaged or unsafe snapshot is logged and the previous one tried; if snapshots exist
        but none is usable, ``SnapshotCorrupt`` is raised rather than silently starting over.
        Collective when a process group exists: every rank must call it, and all get one step.

        The state's tensors are memory-mapped from the snapshot file (read-only pages that
        the ranks of a node share; a write copies the page). ``load_state_dict`` of a model
        copies them; an optimizer keeps what it is given, so give it owned tensors if the
        file may be deleted meanwhile (the Trainer does).
        """
        self.problems = []
        with progress.phase("loading snapshot"):
            self.wait()
            candidates, token = self._agree_on_candidates(self._candidates())
            with _NodeSpool(self.ctx, token, enabled=self.store.remote) as spool:
                for step in candidates:
                    state, reason = self._read(step, spool)
                    usable = self._all_ranks_ok(reason is None)  # every rank has mapped it
                    spool.discard(step)
                    if usable:
                        if self.problems and self._reports():
                            log.warning("resuming from %s instead", self._location(f"step-{step}"))
                        return step, state
                    del state
                    problem = SnapshotProblem(
                        self._location(f"step-{step}"), reason or "unreadable on another rank"
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

    def _agree_on_candidates(self, mine: list[int]) -> tuple[list[int], str]:
        """The steps every rank can read, newest first, and rank 0's token for this load
        (it names the node-local download folder, the same on every rank of a node)."""
        token = secrets.token_hex(4)
        if not self.ctx.distributed:
            return mine, token
        for tries_left in reversed(range(RELIST_TRIES)):
            everyone: list[tuple[list[int], str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (mine, token))
            lists = [entry[0] if entry else [] for entry in everyone]
            token = everyone[0][1] if everyone[0] else token
            if self.scope != "shared" or all(entry == lists[0] for entry in lists):
                break
            if not tries_left:
                differing = [rank for rank, entry in enumerate(lists) if entry != lists[0]]
                raise SnapshotError(
                    f"ranks see different snapshots in {self.directory} "
                    f"(rank 0: {lists[0][:3]}, ranks {differing[:8]} differ): it is not shared",
                    remedy="put the snapshots on a filesystem every node mounts, "
                    "or use scope='node'",
                )
            # Every rank decides alike (the same lists): list again, together. Another writer
            # of a shared directory (a replica group that trains on while this one restarts)
            # may have published or retired a snapshot between two ranks' listings.
            time.sleep(RELIST_WAIT)
            mine = self._candidates()
        common = set(lists[0]).intersection(*map(set, lists[1:]))
        return sorted(common, reverse=True), token

    def _all_ranks_ok(self, ok: bool) -> bool:
        if not self.ctx.distributed:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self._collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _collective_device(self) -> torch.device:
        return self.ctx.device if dist.get_backend() == "nccl" else torch.device("cpu")


class _NodeSpool:
    """A node-local folder where local rank 0 downloads a remote snapshot for its node.

    Every rank of the node maps the one file (named by the load's token and the node), so
    a node holds one copy however many ranks it has; it is deleted once every rank has
    mapped it (the mappings stay valid) and the folder at the end of the load. Without a
    remote store it is never created.
    """

    def __init__(self, ctx: Context, token: str, enabled: bool) -> None:
        self.ctx = ctx
        self.enabled = enabled
        self.root = Path(tempfile.gettempdir()) / f"torchherd-load-{token}-node{ctx.node_rank}"

    def __enter__(self) -> _NodeSpool:
        if self.enabled and self.ctx.is_local_main:
            self.root.mkdir(mode=0o700, exist_ok=True)
        return self

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}-{STATE_FILE}"

    def discard(self, step: int) -> None:
        """Delete step's download (after every rank has mapped it, or refused it)."""
        if self.enabled and self.ctx.is_local_main:
            self.path(step).unlink(missing_ok=True)

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self.ctx.is_local_main:
            shutil.rmtree(self.root, ignore_errors=True)


def _step_of(name: str) -> int:
    match = _STEP_DIR.match(name)
    assert match is not None, name  # stores list only ``step-N`` names
    return int(match.group(1))


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


_waited_at_exit: weakref.WeakSet[Snapshotter] = weakref.WeakSet()


def _finish_before_pools_close(snapshotter: Snapshotter) -> None:
    """Have a normal exit wait for ``snapshotter``'s save before thread pools shut down.

    A non-daemon thread alone is not enough: at exit the interpreter first runs the
    threading-exit hooks, and concurrent.futures' hook forbids new pool work, which the
    save's hashing and uploads need; only then does it join non-daemon threads. Hooks run
    newest first, so one registered after concurrent.futures was imported runs before its.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None or snapshotter in _waited_at_exit:
        return  # an interpreter without the hook still joins the thread (it is not a daemon)
    _waited_at_exit.add(snapshotter)
    import concurrent.futures.thread  # noqa: F401 - its hook must be registered before ours

    reference = weakref.ref(snapshotter)

    def finish() -> None:
        alive = reference()
        if alive is not None:
            alive._join_in_flight()

    try:
        register(finish)
    except RuntimeError:  # the interpreter is already shutting down
        pass
