"""Benchmark: host memory of one node while its ranks resume from a snapshot, against its size.

    python bench/resume_memory.py [--gigabytes 2.1] [--ranks 4] [--no-s3] [--dir DIR]

A state of float32 tensors (4 MiB each, like a model's layers; at least 2 GB) is saved once as
a snapshot, on local disk and on a local S3 server (moto, started here), and dropped from the
page cache. Then ``torchrun --standalone --nproc-per-node RANKS`` (one node) starts ranks that
each hold a live copy of that state (their model: training memory, there before and after a
resume) and resume: ``Snapshotter.load_latest()``, then a copy of every loaded tensor into the
live one (what ``load_state_dict`` does), then the loaded state is let go.

This process samples, every 20 ms, the node's memory held by the ranks: the sum of their PSS
(``/proc/PID/smaps_rollup``: private pages, and shared ones divided among the processes that
map them, so the snapshot file's pages, mapped by every rank, count once). The extra memory of
a resume is the peak during the load minus the level before it;

    ratio = peak extra memory of the node / size of the state        (target <= 1.5)

The baseline is the state's own size, measured here: before this benchmark existed every rank
hashed and unpickled the whole file, about RANKS x (x2 from S3). The bench also prints what the
ranks read: from local disk (``/proc/PID/io`` read_bytes, the page cache emptied before), and
from S3 (bytes each rank wrote to the node's downloaded copy, ``wchar``), so "storage read once
per node" can be checked. CPU state only (no GPU involved).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # run from a checkout without installing
sys.path.insert(1, str(REPO))  # tests.s3server: the local S3 server

TARGET = 1.5
TENSOR_MB = 4
SAMPLE_EVERY = 0.02


def make_state(gigabytes: float) -> dict[str, object]:
    import torch

    count = max(int(gigabytes * 1e9 / (TENSOR_MB << 20)) + 1, 1)
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(1024, 1024, generator=generator) for i in range(count)}


def save_snapshot(location: str, gigabytes: float) -> int:
    """Save the state as snapshot step 1 at ``location``; its serialised size in bytes."""
    import torch

    from torchherd.train import Snapshotter
    from torchherd.train.dist import Context

    ctx = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    snaps = Snapshotter(location, keep=1, ctx=ctx)
    snaps.save(1, {"model": make_state(gigabytes)})
    snaps.close()
    manifest = json.loads(snaps.store.read_manifest("step-1"))
    return int(manifest["files"]["state.pt"]["bytes"])


def upload_as_objects(local: Path, bucket: str, prefix: str) -> None:
    """Put a local snapshot folder's files into ``bucket/prefix``, one PUT each, the manifest
    after the state and ``latest`` last (the order a save uses)."""
    import s3fs

    fs = s3fs.S3FileSystem()
    for relative in ("step-1/state.pt", "step-1/manifest.json", "latest"):
        with open(local / relative, "rb") as body:
            fs.call_s3("put_object", Bucket=bucket, Key=f"{prefix}/{relative}", Body=body)


def drop_from_page_cache(path: Path) -> None:
    """Evict a file's pages, so the resume reads it from storage as after a reboot."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ the ranks


def worker(location: str, marks: Path) -> None:
    import torch

    from torchherd import train

    ctx = train.setup()
    (marks / f"pid-{ctx.rank}").write_text(str(os.getpid()))
    shapes = make_state_shapes()
    live = {name: torch.zeros(shape) for name, shape in shapes.items()}  # the rank's model
    # Made before the level is taken, as a Trainer makes it in its constructor (for a URL
    # that imports s3fs and boto, tens of MB per process, before any resume).
    snaps = train.Snapshotter(location, ctx=ctx)
    ctx.barrier()
    if ctx.is_main:
        (marks / "baseline").write_text(str(time.time()))
    time.sleep(1.5)  # the sampler takes the level before the resume
    ctx.barrier()
    if ctx.is_main:
        (marks / "load").write_text(str(time.time()))
    found = snaps.load_latest()
    assert found is not None, "no snapshot to resume from"
    step, state = found
    for name, tensor in state["model"].items():
        live[name].copy_(tensor)
    del state, found, tensor  # any loaded tensor left alive keeps the file mapped
    ctx.barrier()
    if ctx.is_main:
        (marks / "done").write_text(str(time.time()))
    time.sleep(1.0)  # the level after, for the record
    assert float(live["layer0.weight"].abs().sum()) > 0
    train.teardown()


def make_state_shapes() -> dict[str, tuple[int, int]]:
    gigabytes = float(os.environ["RESUME_BENCH_GB"])
    count = max(int(gigabytes * 1e9 / (TENSOR_MB << 20)) + 1, 1)
    return {f"layer{i}.weight": (1024, 1024) for i in range(count)}


# ------------------------------------------------------------------------------ measuring


def pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def io_counters(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/io") as handle:
            return {k: int(v) for k, v in (line.split(": ") for line in handle)}
    except OSError:
        return {}


class Sampler:
    """Samples the ranks' summed PSS, and marks which phase each sample belongs to."""

    def __init__(self, marks: Path, ranks: int) -> None:
        self.marks = marks
        self.ranks = ranks
        self.samples: list[tuple[str, int]] = []
        self.pids: list[int] = []
        self.io_before: dict[int, dict[str, int]] = {}
        self.io_after: dict[int, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _phase(self) -> str:
        for name in ("done", "load", "baseline"):
            if (self.marks / name).exists():
                return name
        return "start"

    def _run(self) -> None:
        while not self._stop.is_set():
            if len(self.pids) < self.ranks:
                found = sorted(self.marks.glob("pid-*"))
                if len(found) == self.ranks:
                    self.pids = [int(p.read_text()) for p in found]
            phase = self._phase()
            if self.pids:
                if phase == "load" and not self.io_before:
                    self.io_before = {pid: io_counters(pid) for pid in self.pids}
                if phase == "done" and not self.io_after:
                    self.io_after = {pid: io_counters(pid) for pid in self.pids}
                self.samples.append((phase, sum(pss_bytes(pid) for pid in self.pids)))
            self._stop.wait(SAMPLE_EVERY)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def levels(self) -> tuple[int, int, int]:
        """(level before the resume, peak during it, level after)."""
        before = [value for phase, value in self.samples if phase == "baseline"]
        during = [value for phase, value in self.samples if phase == "load"]
        after = [value for phase, value in self.samples if phase == "done"]
        if not before or not during:
            raise RuntimeError("the sampler saw no baseline or no load (the ranks were too fast)")
        return int(statistics.median(before)), max(during), (after or [0])[0]

    def reads(self, key: str) -> list[int]:
        return [
            self.io_after.get(pid, {}).get(key, 0) - self.io_before.get(pid, {}).get(key, 0)
            for pid in self.pids
        ]


def resume_on_one_node(location: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="resume-bench-") as scratch:
        marks = Path(scratch)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += [f"--nproc-per-node={args.ranks}", __file__, "--worker", location, str(marks)]
        sampler = Sampler(marks, args.ranks)
        started = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        elapsed = time.perf_counter() - started
        sampler.stop()
        if done.returncode != 0:
            raise RuntimeError(f"the ranks failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        before, peak, after = sampler.levels()
        load_seconds = float((marks / "done").read_text()) - float((marks / "load").read_text())
        return {
            "before": before,
            "peak": peak,
            "after": after,
            "read_bytes": sampler.reads("read_bytes"),
            "wchar": sampler.reads("wchar"),
            "load_seconds": load_seconds,
            "wall": elapsed,
        }


def report(kind: str, size: int, ranks: int, found: dict) -> bool:
    gib = 1 << 30
    extra = found["peak"] - found["before"]
    ratio = extra / size
    print(f"{kind}: state {size / 1e9:.2f} GB, {ranks} ranks on one node (CPU state)")
    print(
        f"  node memory (sum of the ranks' PSS): before {found['before'] / gib:.2f} GiB, "
        f"peak during resume {found['peak'] / gib:.2f} GiB, after {found['after'] / gib:.2f} GiB"
    )
    print(f"  resume took {found['load_seconds']:.1f}s")
    if kind == "local disk":
        reads = found["read_bytes"]
        print(
            "  read from storage per rank: "
            + ", ".join(f"{r / 1e9:.2f} GB" for r in reads)
            + f" (total {sum(reads) / size:.2f}x the file)"
        )
    else:
        written = found["wchar"]
        print(
            "  written to the node's downloaded copy, per rank: "
            + ", ".join(f"{r / 1e9:.2f} GB" for r in written)
            + " (one download per node)"
        )
    met = ratio <= TARGET
    print(
        f"  ratio = peak extra node memory / state size = {extra / 1e9:.2f} / {size / 1e9:.2f} "
        f"= {ratio:.2f}  (target <= {TARGET}: {'met' if met else 'not met'})"
    )
    return met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=2.1, help="size of the state (>= 2)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks on the node")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) half")
    parser.add_argument("--no-local", action="store_true", help="skip the local-disk half")
    parser.add_argument("--dir", default=None, help="where the local snapshot goes")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return 0

    env = dict(os.environ, OMP_NUM_THREADS="1", RESUME_BENCH_GB=str(args.gigabytes))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    results = []
    if not args.no_local:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="resume-bench-") as scratch:
            local = Path(scratch) / "snapshots"
            size = save_snapshot(str(local), args.gigabytes)
            drop_from_page_cache(local / "step-1" / "state.pt")
            found = resume_on_one_node(str(local), args, env)
            results.append(report("local disk", size, args.ranks, found))
    if not args.no_s3:
        results.append(measure_s3(args, env))
    print("all targets met" if all(results) else "some targets not met")
    return 0


def measure_s3(args: argparse.Namespace, env: dict[str, str]) -> bool:
    try:
        import s3fs  # noqa: F401

        from tests.s3server import make_bucket, s3_server
    except ImportError as exc:
        print(f"S3: skipped ({exc}; pip install -e '.[dev]')")
        return True
    with s3_server() as server, tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        make_bucket(server, "bench")
        os.environ.update(server.env)
        location = "s3://bench/snapshots"
        # Saved locally and put as single objects: moto fails to assemble a multipart upload
        # of this size (a limit of the stand-in server, not of the layout, which is the same).
        local = Path(scratch) / "snapshots"
        size = save_snapshot(str(local), args.gigabytes)
        upload_as_objects(local, "bench", "snapshots")
        (local / "step-1" / "state.pt").unlink()
        return report(
            "S3 (moto on loopback)",
            size,
            args.ranks,
            resume_on_one_node(location, args, dict(env, **server.env)),
        )


if __name__ == "__main__":
    raise SystemExit(main())
