"""Aborts at exit, with and without herd's exit guard, side by side.

A plain two-rank DDP script on Gloo (a few steps, then it returns: no teardown, as most
scripts end) is started again and again in real interpreters, under load, alternately

  without the guard: the environment of any process, as plain torchrun gives its workers;
  with the guard:    the environment herd's node wrapper gives its workers
                     (exit_guard.for_workers: the worker site first on PYTHONPATH, whose
                     sitecustomize installs the wait; plus the job's HERD_JOB_ID).

and every rank that dies of SIGABRT ("terminate called without an active exception": a Gloo
thread ended inside a C++ destructor while the interpreter shut down) is counted. It prints
the aborted runs of each side, the ratio with/without, and a met/not met line: the target is
no abort with the guard; with no abort in the baseline either, the run proved nothing and
says so (more runs, more load).

    python bench/exit_guard.py [--runs 200] [--parallel 4] [--busy 2] [--async-last]

``--async-last`` ends the script with un-awaited async all-reduces, which widens the window
(a Gloo thread still busy when the interpreter shuts down) for a quicker, smaller count.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torchherd.exit_guard import for_workers  # noqa: E402

SCRIPT = """\
import os
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(10):
    optimizer.zero_grad()
    model(torch.randn(32, 64)).sum().backward()
    optimizer.step()
if os.environ.get("ASYNC_LAST"):
    for _ in range(32):
        dist.all_reduce(torch.ones(4096), async_op=True)
"""


def busy_loop() -> None:
    while True:
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_run(script: Path, guard: bool, number: int, async_last: bool) -> str:
    """Two ranks of the script; "ok", "abort" (a rank died of SIGABRT) or "failed: ..."."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("HERD_JOB_ID", "PYTHONPATH")}
        env |= {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
        if async_last:
            env["ASYNC_LAST"] = "1"
        if guard:
            env["HERD_JOB_ID"] = f"exit-guard-bench-{number}"
            for_workers(env)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    codes, errors = [], []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        codes.append(proc.returncode)
        errors.append(err)
    if -signal.SIGABRT in codes:
        return "abort"
    if any(codes):
        last = next((e.strip().splitlines()[-1] for e in errors if e.strip()), "")
        return f"failed: exit codes {codes} {last}"
    return "ok"


def count(
    runs: int, parallel: int, async_last: bool, say: bool = True
) -> dict[bool, dict[str, int]]:
    """Alternate guard/no guard, ``parallel`` runs at a time; the outcomes of each side."""
    totals: dict[bool, dict[str, int]] = {False: {}, True: {}}
    with tempfile.TemporaryDirectory(prefix="herd-exit-guard-") as scratch:
        script = Path(scratch) / "plain_ddp.py"
        script.write_text(SCRIPT)
        plan = [(n % 2 == 1, n) for n in range(2 * runs)]
        with ThreadPoolExecutor(parallel) as pool:
            outcomes = pool.map(lambda job: (job[0], one_run(script, *job, async_last)), plan)
            for done, (guard, outcome) in enumerate(outcomes, start=1):
                side = totals[guard]
                side[outcome] = side.get(outcome, 0) + 1
                if say and done % 20 == 0:
                    print(f"  {done}/{2 * runs} runs", file=sys.stderr, flush=True)
    return totals


def report(totals: dict[bool, dict[str, int]], runs: int) -> bool:
    """Print both sides and the verdict; True when the target is met."""
    without, with_guard = totals[False].get("abort", 0), totals[True].get("abort", 0)
    for guard, label in ((False, "without the guard"), (True, "with the guard   ")):
        others = {k: v for k, v in totals[guard].items() if k not in ("ok", "abort")}
        extra = f", other failures {others}" if others else ""
        print(f"{label}: {totals[guard].get('abort', 0)} of {runs} runs aborted{extra}")
    if without:
        print(f"ratio (aborts with / without): {with_guard / without:.2f}")
    else:
        print("ratio (aborts with / without): - (the baseline never aborted)")
    if with_guard:
        print("target (no abort with the guard): not met")
        return False
    if not without:
        print(
            "target (no abort with the guard): met, but unproven: the baseline did not abort "
            "either (raise --runs or --busy)"
        )
        return True
    print("target (no abort with the guard): met")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="runs per side")
    parser.add_argument("--parallel", type=int, default=4, help="runs at a time")
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes for load")
    parser.add_argument("--async-last", action="store_true", help="end on un-awaited all-reduces")
    args = parser.parse_args()
    loaders = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.busy)]
    for loader in loaders:
        loader.start()
    started = time.monotonic()
    try:
        totals = count(args.runs, args.parallel, args.async_last)
    finally:
        for loader in loaders:
            loader.terminate()
    print(
        f"{2 * args.runs} runs in {time.monotonic() - started:.0f} s "
        f"({args.parallel} at a time, {args.busy} busy loop(s))"
    )
    return 0 if report(totals, args.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
