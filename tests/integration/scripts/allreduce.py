"""Test job: every rank all-reduces (rank + 1) and prints the sum; can fail or sleep on demand.

--fail-rank R --code C   rank R exits with code C before the all-reduce
--sleep S                every rank sleeps S seconds after the all-reduce (to be interrupted)
--ignore-sigterm         every rank ignores SIGTERM (only SIGKILL ends it)
"""

import argparse
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--code", type=int, default=3)
parser.add_argument("--sleep", type=float, default=0)
parser.add_argument("--ignore-sigterm", action="store_true")
args = parser.parse_args()
if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if rank == args.fail_rank:
    print(f"rank {rank} failing on purpose with code {args.code}", file=sys.stderr, flush=True)
    os._exit(args.code)
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(
    f"RESULT rank={rank} world={world} sum={value.item():.0f} host={socket.gethostname()} "
    f"master={os.environ['MASTER_ADDR']}",
    flush=True,
)
if args.sleep:
    print(f"SLEEPING rank={rank} pid={os.getpid()}", flush=True)
    time.sleep(args.sleep)
dist.destroy_process_group()
