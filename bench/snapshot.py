"""Benchmark: Snapshotter.save throughput against one plain write of the same bytes.

    python bench/snapshot.py [--megabytes 256] [--rounds 7] [--dir DIR]

The state is a dict of float32 tensors (like a model's). The baseline serialises it once in
memory and times a single ``write`` of those bytes plus ``fsync`` (so both sides are durable).
The snapshot side times ``Snapshotter.save``: torch.save streamed to a temporary folder with
SHA-256 on the way, fsync of file, manifest and folder, rename, ``latest`` pointer, pruning.
Rounds alternate; prints ratio = baseline_time / snapshot_time (target >= 0.5).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # run from a checkout without installing

import torch  # noqa: E402

from torchherd.train import Snapshotter  # noqa: E402
from torchherd.train.dist import Context  # noqa: E402

TARGET = 0.5


def make_state(megabytes: int) -> dict[str, torch.Tensor]:
    """Tensors of 4 MiB each, like the layers of a model, filled with random values."""
    generator = torch.Generator().manual_seed(0)
    count = max(megabytes // 4, 1)
    return {f"layer{i}.weight": torch.randn(1024, 1024, generator=generator) for i in range(count)}


def plain_write(path: Path, payload: bytes) -> float:
    started = time.perf_counter()
    with open(path, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed


def snapshot_save(snaps: Snapshotter, step: int, state: dict[str, torch.Tensor]) -> float:
    started = time.perf_counter()
    snaps.save(step, state)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256, help="size of the state")
    parser.add_argument("--rounds", type=int, default=7, help="timed saves of each kind")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args(argv)

    state = make_state(args.megabytes)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    ctx = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    baseline: list[float] = []
    ours: list[float] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        snaps = Snapshotter(Path(scratch) / "snapshots", keep=2, ctx=ctx)
        snapshot_save(snaps, 0, state)  # warm-up: first-touch costs of the folder and pools
        for index in range(args.rounds):
            first_plain = index % 2 == 0
            if first_plain:
                baseline.append(plain_write(Path(scratch) / "plain.bin", payload))
            ours.append(snapshot_save(snaps, index + 1, state))
            if not first_plain:
                baseline.append(plain_write(Path(scratch) / "plain.bin", payload))
        assert snaps.load_latest() is not None
        snaps.close()

    size_gb = len(payload) / 1e9
    base, snap = statistics.median(baseline), statistics.median(ours)
    ratio = base / snap
    print(f"state: {len(state)} tensors, {len(payload) / 2**20:.0f} MiB serialised")
    print(f"plain write+fsync: median {base:.3f}s ({size_gb / base:.2f} GB/s)")
    print(f"Snapshotter.save:  median {snap:.3f}s ({size_gb / snap:.2f} GB/s)")
    print(f"ratio = snapshot_throughput / plain_write_throughput = {ratio:.3f}")
    print(f"target >= {TARGET}: {'PASS' if ratio >= TARGET else 'BELOW TARGET'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
