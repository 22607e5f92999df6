"""The reference workload of `herd bench scaling` (runs on the nodes, under torchrun).

A small MLP trained with DDP on synthetic data for a fixed number of steps per rank (weak
scaling: every rank does the same work, so a perfect cluster keeps the per-rank rate as nodes
are added). The same steps are then run under ``no_sync()`` (no gradient all-reduce): the
difference is the step time spent waiting on communication that backward did not hide.
Rank 0 prints one line ``HERD_SCALING {json}``; times are the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchherd.bench.markers import SCALING as MARKER
from torchherd.train.dist import teardown_and_exit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per rank")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers of the MLP")
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda") if gpu else torch.device("cpu")
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(args.width, 10)).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    inputs = torch.randn(args.batch, args.width, device=device)
    labels = torch.randint(0, 10, (args.batch,), device=device)

    def steps(count: int, sync: bool) -> float:
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()
        started = time.perf_counter()
        for _ in range(count):
            with nullcontext() if sync else ddp.no_sync():
                loss = nn.functional.cross_entropy(ddp(inputs), labels)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - started], device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        return float(elapsed.item())

    steps(args.warmup, True)
    synced = steps(args.steps, True)
    alone = steps(args.steps, False)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        answer = {
            "world_size": world,
            "steps": args.steps,
            "batch": args.batch,
            "params": sum(p.numel() for p in model.parameters()),
            "seconds": synced,
            "compute_seconds": alone,
            "samples_per_s": world * args.batch * args.steps / synced,
        }
        print(MARKER + json.dumps(answer), flush=True)
    teardown_and_exit(0)  # a barrier, then out without the destructors that can deadlock


if __name__ == "__main__":
    main()
