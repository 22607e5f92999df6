"""`herd demo` again and again under load: how many runs of N succeed.

The demo is a newcomer's first command, so a rare crash at exit (a rank dying at
destroy_process_group on a loaded machine) matters. This runs `herd demo` N times in a row
while busy-loop processes keep the other cores loaded, and prints how many succeeded, with
the exit code and last lines of every failure.

    python bench/demo_loop.py [--runs 50] [--busy 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time


def busy_loop() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="demo runs in a row")
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes for load")
    args = parser.parse_args()
    loaders = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.busy)]
    for loader in loaders:
        loader.start()
    succeeded, failures, times = 0, [], []
    try:
        with tempfile.TemporaryDirectory(prefix="herd-demo-loop-") as home:
            for run in range(1, args.runs + 1):
                started = time.monotonic()
                done = subprocess.run(
                    [sys.executable, "-m", "torchherd", "demo"],
                    env=dict(os.environ, HERD_HOME=home),
                    capture_output=True,
                    text=True,
                    timeout=300,
                    stdin=subprocess.DEVNULL,
                )
                times.append(time.monotonic() - started)
                if done.returncode == 0 and "What happened" in done.stdout:
                    succeeded += 1
                else:
                    tail = (done.stdout + done.stderr).strip().splitlines()[-8:]
                    failures.append((run, done.returncode, tail))
                print(
                    f"run {run}/{args.runs}: exit {done.returncode}, {times[-1]:.1f} s", flush=True
                )
    finally:
        for loader in loaders:
            loader.terminate()
    for run, code, tail in failures:
        print(f"\nrun {run} failed with exit code {code}:")
        print("\n".join(f"    {line}" for line in tail))
    times.sort()
    print(
        f"\n{succeeded} of {args.runs} demo runs succeeded under load ({args.busy} busy "
        f"loop(s)); median {times[len(times) // 2]:.1f} s per run"
    )
    return 0 if succeeded == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
