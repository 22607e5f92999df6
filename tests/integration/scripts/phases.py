"""Test job for supervision: all-reduce steps with silent phases and awkward behaviours.

Every rank prints `STARTED rank=R pid=P attempt=A` before the process group exists, and
`STEPPING rank=R pid=P` after its first all-reduce; after that nothing is printed and no beat
is sent unless asked, so every silent phase is silent for real.

--steps N              all-reduce steps (one every 50 ms) before and after the phases
--pause-before-init S  sleep S s before init_process_group (a test freezes a rank there)
--compute S            every rank computes (matmuls) for S s, printing nothing
--save S               rank 0 writes to a file for S s (about 20 MB/s, fsynced), the others
                       wait in a barrier, printing nothing
--sigterm-delay S      on SIGTERM, take S s (a checkpoint on SIGTERM) before exiting 0;
                       prints `SIGTERM rank=R done after S s`
--ignore-sigterm       ignore SIGTERM (a worker only SIGKILL ends)
--fail-rank R          rank R exits with code 3 after the phases
--fail-at-step K       with --fail-rank: fail at step K of the last loop instead (0: at once)
--progressive          with --fail-rank: fail at step 10 x (attempt + 1), at most 30, after
                       beating the step before: every attempt but the capped ones makes
                       progress
--idle                 after the first all-reduce, sleep for ever (no collective, no CPU)
--linger               after the phases, print `LINGERING rank=R` and sleep for ever
--beat                 beat every step (torchherd.progress.beat)
--report-saved         rank 0 reports a committed snapshot at step 1 after its first
                       all-reduce (torchherd.progress.saved), as a script that saves does
"""

import argparse
import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from torchherd.progress import beat

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--pause-before-init", type=float, default=0)
parser.add_argument("--compute", type=float, default=0)
parser.add_argument("--save", type=float, default=0)
parser.add_argument("--sigterm-delay", type=float, default=0)
parser.add_argument("--ignore-sigterm", action="store_true")
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--fail-at-step", type=int, default=0)
parser.add_argument("--progressive", action="store_true")
parser.add_argument("--idle", action="store_true")
parser.add_argument("--linger", action="store_true")
parser.add_argument("--beat", action="store_true")
parser.add_argument("--report-saved", action="store_true")
args = parser.parse_args()

rank = int(os.environ["RANK"])
attempt = int(os.environ.get("HERD_ATTEMPT", "0"))
print(f"STARTED rank={rank} pid={os.getpid()} attempt={attempt}", flush=True)

if args.sigterm_delay:

    def slow_exit(*_: object) -> None:
        time.sleep(args.sigterm_delay)
        print(f"SIGTERM rank={rank} done after {args.sigterm_delay:g} s", flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, slow_exit)
if args.ignore_sigterm:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if args.pause_before_init:
    time.sleep(args.pause_before_init)

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
print(f"STEPPING rank={rank} pid={os.getpid()}", flush=True)
if args.report_saved and rank == 0:
    from torchherd.progress import saved

    saved(1, "step-1 (a test's word)")
if args.idle:
    while True:
        time.sleep(3600)


def steps(count: int, first: int, fail_at: int | None) -> int:
    step = first
    for step in range(first, first + count):
        if fail_at is not None and step == fail_at:
            if args.progressive:  # the step reached, past beat()'s twice-a-second throttle
                time.sleep(0.6)
                beat(step - 1)
            print(f"rank {rank} failing at step {step}", file=sys.stderr, flush=True)
            os._exit(3)
        dist.all_reduce(value)
        value.fill_(1.0)
        if args.beat:
            beat(step)
        time.sleep(0.05)
    return step + 1


step = steps(args.steps, 1, None)
if args.compute:
    x = torch.randn(256, 256)
    end = time.monotonic() + args.compute
    while time.monotonic() < end:
        x = torch.tanh(x @ x / 256)
    dist.barrier()
if args.save:
    if rank == 0:
        block = os.urandom(1 << 20)
        with tempfile.TemporaryFile() as out:
            end = time.monotonic() + args.save
            while time.monotonic() < end:
                out.write(block)
                out.flush()
                os.fsync(out.fileno())
                out.seek(0)  # stay at 1 MiB on disk: the test wants time, not space
                time.sleep(0.05)
    dist.barrier()
if args.linger:
    print(f"LINGERING rank={rank}", flush=True)
    while True:
        time.sleep(3600)
# Every rank takes the same number of steps; only the failing rank fails on its way.
planned = min(10 * (attempt + 1), 30) if args.progressive else args.fail_at_step or step
first = 1 if args.progressive else step
count = max(args.steps, planned - first + 6) if args.fail_rank >= 0 else args.steps
step = steps(count, first, planned if rank == args.fail_rank else None)
dist.barrier()
print(f"DONE rank={rank}", flush=True)
dist.destroy_process_group()
