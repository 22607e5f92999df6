"""The CPU a worker spends from its start to its exit, with and without herd's exit handler.

A worker-like script (imports torch and torch.distributed, builds a small model, takes a few
optimizer steps, then returns, as most scripts end) runs again and again in real
interpreters, alternately

  plain:  the environment of any process, as plain torchrun gives its workers;
  herd:   the environment herd's node wrapper gives its workers (exit_guard.for_workers: the
          worker site first on PYTHONPATH, whose sitecustomize registers the exit handler,
          plus the job's HERD_JOB_ID and torchrun's RANK).

and the CPU of each run (user + system, from the rusage of reaped children) is recorded. The
handler's collect-and-freeze (exit_guard.spare_the_final_sweeps) spares the interpreter's
shutdown its sweeps over torch's heap; its 0.25-s wait for Gloo's threads is a sleep and
costs no CPU. It prints the medians, the ratio herd / plain, and a met/not met line (target
<= 0.9; the sweeps are about a sixth of this script's CPU on this machine, a third of a
bare `import torch`'s).

    python bench/worker_exit.py [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torchherd.exit_guard import for_workers  # noqa: E402

TARGET = 0.9
SCRIPT = """\
import torch
import torch.distributed  # noqa: F401 - a worker's imports
from torch import nn

model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(20):
    loss = model(torch.randn(64, 256)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("done", flush=True)
"""


def environment(herd: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HERD_JOB_ID", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if herd:
        for_workers(env)
        env.update(HERD_JOB_ID="bench-worker-exit", RANK="0")
    return env


def cpu_of_one_run(script: Path, herd: bool) -> float:
    """CPU seconds (user + system) of one run: what this process's reaped children used,
    before and after it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, str(script)], env=environment(herd), capture_output=True, timeout=600
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or b"done" not in done.stdout:
        raise SystemExit(f"a run failed (exit {done.returncode}): {done.stderr.decode()[-2000:]}")
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per side, interleaved")
    args = parser.parse_args()
    cpu: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="herd-worker-exit-") as scratch:
        script = Path(scratch) / "worker.py"
        script.write_text(SCRIPT)
        for number in range(args.runs):
            for herd in (False, True):
                cpu[herd].append(cpu_of_one_run(script, herd))
            print(f"  run {number + 1}: plain {cpu[False][-1]:.2f} s, herd {cpu[True][-1]:.2f} s")
    plain, herd = statistics.median(cpu[False]), statistics.median(cpu[True])
    ratio = herd / plain
    print(
        f"worker CPU, start to exit, median of {args.runs}: plain {plain:.2f} s, herd {herd:.2f} s"
    )
    print(f"herd / plain: {ratio:.2f} (<= {TARGET}): {'met' if ratio <= TARGET else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
