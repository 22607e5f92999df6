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
import signal
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
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a run is hung")
    args = parser.parse_args()
    loaders = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.busy)]
    for loader in loaders:
        loader.start()
    succeeded, times = 0, []
    failures: list[tuple[int, int | str, list[str]]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="herd-demo-loop-") as home:
            for run in range(1, args.runs + 1):
                started = time.monotonic()
                process = subprocess.Popen(
                    [sys.executable, "-m", "torchherd", "demo"],
                    env=dict(os.environ, HERD_HOME=home),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # a hung run is ended with everything it started
                )
                try:
                    out, _ = process.communicate(timeout=args.timeout)
                    code: int | str = process.returncode
                except subprocess.TimeoutExpired:
                    # herd's own teardown first (it stops the job within grace + 10 s), then
                    # SIGKILL for whatever of herd is left.
                    process.send_signal(signal.SIGTERM)
                    try:
                        out, _ = process.communicate(timeout=30)
                    except subprocess.TimeoutExpired:
                        os.killpg(process.pid, signal.SIGKILL)
                        out, _ = process.communicate(timeout=30)
                    code = f"none: hung, killed after {args.timeout:.0f} s"
                times.append(time.monotonic() - started)
                if code == 0 and "What happened" in out:
                    succeeded += 1
                else:
                    failures.append((run, code, out.strip().splitlines()[-8:]))
                print(f"run {run}/{args.runs}: exit {code}, {times[-1]:.1f} s", flush=True)
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
