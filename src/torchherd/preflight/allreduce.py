"""The all-reduce job of `herd doctor --collective` (runs on the nodes, under torchrun).

Like nccl-tests' all_reduce_perf: for each message size, a few warm-up rounds, then timed rounds;
the slowest rank's time counts. algbw = bytes / time; busbw = algbw x 2(n-1)/n, which compares
directly with link speed whatever the world size. NCCL on GPUs, Gloo on CPUs. Rank 0 prints one
line ``HERD_ALLREDUCE {json}`` that the doctor reads back from the job's output.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

MARKER = "HERD_ALLREDUCE "
DEFAULT_SIZES = (4 << 10, 256 << 10, 4 << 20, 32 << 20)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, DEFAULT_SIZES)),
        help="message sizes in bytes, comma-separated",
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="rough time budget per size")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]

    gpu = torch.cuda.is_available()
    backend = "nccl" if gpu else "gloo"
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    device = torch.device("cuda") if gpu else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()

    check = torch.ones(1024, device=device)
    dist.all_reduce(check)
    correct = bool(torch.all(check == world).item())

    rows = []
    for size in sizes:
        tensor = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        iterations = _iterations(tensor, args.seconds, gpu)
        _sync(gpu)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(tensor)
        _sync(gpu)
        elapsed = torch.tensor([(time.perf_counter() - started) / iterations], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        seconds = float(elapsed.item())
        algbw = tensor.numel() * 4 / seconds / 1e9
        rows.append(
            {
                "size_bytes": tensor.numel() * 4,
                "seconds": seconds,
                "algbw_gbytes": algbw,
                "busbw_gbytes": algbw * 2 * (world - 1) / world,
            }
        )
    if rank == 0:
        print(
            MARKER
            + json.dumps(
                {"backend": backend, "world_size": world, "correct": correct, "rows": rows}
            ),
            flush=True,
        )
    dist.destroy_process_group()


def _iterations(tensor: torch.Tensor, budget: float, gpu: bool) -> int:
    """Warm up, then pick a round count that fits the budget (the same on every rank)."""
    _sync(gpu)
    started = time.perf_counter()
    for _ in range(2):
        dist.all_reduce(tensor)
    _sync(gpu)
    per_round = torch.tensor([(time.perf_counter() - started) / 2], device=tensor.device)
    dist.all_reduce(per_round, op=dist.ReduceOp.MAX)  # every rank must agree on the count
    return max(3, min(200, int(budget / max(float(per_round.item()), 1e-6))))


def _sync(gpu: bool) -> None:
    if gpu:
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
