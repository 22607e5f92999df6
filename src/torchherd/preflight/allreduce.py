"""The all-reduce job of `herd doctor --collective` and `herd bench allreduce` (runs on the
nodes, under torchrun).

Like nccl-tests' all_reduce_perf: for each message size, a few warm-up rounds, then timed rounds;
the slowest rank's time counts. algbw = bytes / time; busbw = algbw x 2(n-1)/n, which compares
directly with link speed whatever the world size. After the timed rounds each size is checked:
every rank fills the buffer with its rank + 1 and must get the exact sum back. NCCL on GPUs, Gloo
on CPUs. Rank 0 prints one line ``HERD_ALLREDUCE {json}`` that the launcher reads back.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from torchherd.train.dist import teardown_and_exit

from .report import bus_bandwidth

MARKER = "HERD_ALLREDUCE "
DEFAULT_SIZES = (4 << 10, 256 << 10, 4 << 20, 32 << 20)
WRONG_RANK_VAR = "HERD_ALLREDUCE_WRONG_RANK"
"""For tests of the check itself: the rank named here sends one more than its share, so the sum
every rank gets back is really wrong and the check must say so (exit 1)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, DEFAULT_SIZES)),
        help="message sizes in bytes, comma-separated",
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="rough time budget per size")
    parser.add_argument("--iters", type=int, default=0, help="timed rounds per size (0: budget)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]

    gpu = torch.cuda.is_available()
    backend = "nccl" if gpu else "gloo"
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    device = torch.device("cuda") if gpu else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()

    rows = []
    for size in sizes:
        tensor = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        iterations = _iterations(tensor, args.seconds, gpu)  # warms up too
        iterations = args.iters or iterations
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
                "busbw_gbytes": bus_bandwidth(algbw, world),
                "iterations": iterations,
                "correct": _correct(tensor, rank, world),
            }
        )
    if rank == 0:
        answer = {
            "backend": backend,
            "world_size": world,
            "correct": all(row["correct"] for row in rows),
            "rows": rows,
        }
        print(MARKER + json.dumps(answer), flush=True)
    teardown_and_exit(0)  # a barrier, then out without the destructors that can deadlock


def _correct(tensor: torch.Tensor, rank: int, world: int) -> bool:
    """Every rank sends rank + 1 everywhere; every element must come back as the exact sum
    (small integers are exact in float32), and every rank must agree that it did."""
    wrong = os.environ.get(WRONG_RANK_VAR) == str(rank)
    tensor.fill_(rank + 1 + int(wrong))
    dist.all_reduce(tensor)
    mine = 1.0 if bool(torch.all(tensor == world * (world + 1) / 2)) else 0.0
    ok = torch.tensor([mine], device=tensor.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item() == 1.0)


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
