"""Local copy bandwidth of one GPU: what the GPU check measures where one GPU leaves NCCL no
link between GPUs to measure.

    python -m bench.gpu.copy_worker [--megabytes 1024] [--rounds 20] [--device cuda]

Device to device (a ``copy_`` between two buffers on the GPU; the bytes are read once and
written once) and host to device from pinned memory (the path of data loading and of a
snapshot's staging, in reverse), each after a warm-up. Prints one line ``HERD_GPU_COPY {json}``
with GB/s = bytes copied / time.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

MARKER = "HERD_GPU_COPY "


def _timed_copies(target: torch.Tensor, source: torch.Tensor, rounds: int) -> float:
    """Seconds per copy, after one warm-up copy, between two synchronisations."""
    target.copy_(source, non_blocking=True)
    _sync(target, source)
    started = time.perf_counter()
    for _ in range(rounds):
        target.copy_(source, non_blocking=True)
    _sync(target, source)
    return (time.perf_counter() - started) / rounds


def _sync(*tensors: torch.Tensor) -> None:
    if any(t.device.type == "cuda" for t in tensors):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--megabytes", type=int, default=1024, help="size of each copy")
    parser.add_argument("--rounds", type=int, default=20, help="timed copies of each kind")
    parser.add_argument("--device", default="cuda", help="the GPU")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    size = args.megabytes << 20
    source = torch.empty(size, dtype=torch.uint8, device=device).random_()
    target = torch.empty_like(source)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda").random_()
    device_seconds = _timed_copies(target, source, args.rounds)
    host_seconds = _timed_copies(target, host, args.rounds)
    answer = {
        "bytes": size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "device_to_device_gbytes": size / device_seconds / 1e9,
        "host_to_device_gbytes": size / host_seconds / 1e9,
        "rounds": args.rounds,
    }
    print(MARKER + json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
