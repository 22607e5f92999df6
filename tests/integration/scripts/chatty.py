"""Test job: every rank prints --rate lines of 200 bytes per second for --seconds, then DONE.

--huge-line MiB   rank 0 first prints one line of that many MiB (a line over any reader's limit)
"""

import argparse
import os
import time

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--seconds", type=float, default=10)
parser.add_argument("--rate", type=int, default=100)
parser.add_argument("--huge-line", type=float, default=0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 0 and args.huge_line:
    print("H" * int(args.huge_line * (1 << 20)), flush=True)
end = time.monotonic() + args.seconds
count = 0
while time.monotonic() < end:
    count += 1
    print(f"rank {rank} line {count:08d} " + "x" * 170, flush=True)
    time.sleep(1 / args.rate)
dist.barrier()
print(f"DONE rank={rank} lines={count} pid={os.getpid()}", flush=True)
dist.destroy_process_group()
