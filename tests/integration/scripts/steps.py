"""Test job: a plain loop of all-reduces (no DDP), one step every 50 ms, with progress beats.

Rank 0 prints "step N" every 10 steps; every rank calls torchherd.progress.beat(step) and
prints "STEPPING rank=R pid=P host=H" once, after its first all-reduce, so a test can pick a
victim. --steps N ends the job after N steps; --fail-rank R makes rank R exit with code 3 at
once (every attempt: a crash loop); --fail-host H makes the ranks on host H exit with code 3
at step 5 (every attempt there); --quiet prints nothing after the first line;
--save-on-request is a plain script's save-and-stop: once herd asks (torchherd.progress
.save_requested(), polled every step), every rank agrees on the step, "saves" it and tells herd
(progress.saved), then the job ends.
"""

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from torchherd import progress
from torchherd.progress import beat

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100000)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--fail-host", default="")
parser.add_argument("--quiet", action="store_true")
parser.add_argument("--save-on-request", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == args.fail_rank:
    print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
    os._exit(3)
value = torch.ones(1)
for step in range(1, args.steps + 1):
    dist.all_reduce(value)
    value.fill_(1.0)
    beat(step)
    if step == 5 and args.fail_host and socket.gethostname() == args.fail_host:
        print(f"rank {rank} on {args.fail_host} failing on purpose", file=sys.stderr, flush=True)
        os._exit(3)
    if step == 1:
        host = socket.gethostname()
        print(f"STEPPING rank={rank} pid={os.getpid()} host={host}", flush=True)
    elif rank == 0 and step % 10 == 0 and not args.quiet:
        print(f"step {step}", flush=True)
    if args.save_on_request:
        # Every rank stops at the same step: the request reaches ranks at different steps.
        asked = torch.tensor([1.0 if progress.save_requested() else 0.0])
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)
        if asked.item():
            if rank == 0:
                progress.saved(step, f"step-{step} (plain script)")
                print(f"SAVED step={step}", flush=True)
            break
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
