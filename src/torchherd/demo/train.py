"""The demo job: data-parallel training of a small regression model on CPU workers (Gloo).

It reads only the variables torchrun sets, so it runs the same under `herd launch`, plain
torchrun, or as a single process. Every rank says hello; rank 0 reports progress and writes a
summary to $HERD_DEMO_SUMMARY when set.

It is instrumented as a real script would be, so the demo's `herd report` page shows what a
user's will: every rank beats its step (torchherd.progress, a no-op outside herd) and rank 0
appends one JSON line per step (step, loss, samples/s, wall time) to ``metrics.jsonl`` in the
``--run-dir`` it is given, the file torchherd.train writes and `herd report` draws.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torchherd import progress
from torchherd.train.dist import teardown_and_exit

METRICS_EVERY = 5
"""Steps per metrics.jsonl line: 60 points draw the curve; 300 lines would only be bigger."""


def main(steps: int = 300, batch: int = 64, run_dir: str | None = None) -> None:
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    print(f"hello from rank {rank} of {world} on {socket.gethostname()} (pid {os.getpid()})")

    torch.manual_seed(0)
    true_weights = torch.randn(16, 1)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )
    if distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank sees different data

    metrics = None
    if rank == 0 and run_dir:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        metrics = open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    started = window = time.monotonic()
    first_loss = last_loss = 0.0
    for step in range(1, steps + 1):
        inputs = torch.randn(batch, 16, generator=generator)
        targets = inputs @ true_weights + 0.01 * torch.randn(batch, 1, generator=generator)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients across every rank here
        optimizer.step()
        last_loss = loss.item()
        if step == 1:
            first_loss = last_loss
        progress.beat(step, now=step == steps)  # the last step is the one a report shows
        if metrics is not None and (step % METRICS_EVERY == 0 or step == 1):
            now = time.monotonic()
            seen = (METRICS_EVERY if step > 1 else 1) * batch * world
            record = {"step": step, "loss": round(last_loss, 6), "time": round(time.time(), 3)}
            if now > window:
                record["samples_per_s"] = round(seen / (now - window), 1)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            window = now
        if rank == 0 and (step % 100 == 0 or step == 1):
            print(f"step {step:4d}/{steps}  loss {last_loss:.4f}")
    elapsed = time.monotonic() - started
    if metrics is not None:
        metrics.close()

    summary_path = os.environ.get("HERD_DEMO_SUMMARY")
    if rank == 0 and summary_path:
        with open(summary_path, "w") as handle:
            json.dump(
                {
                    "world_size": world,
                    "steps": steps,
                    "samples": steps * batch * world,
                    "first_loss": first_loss,
                    "last_loss": last_loss,
                    "seconds": elapsed,
                },
                handle,
            )
    if distributed:
        teardown_and_exit(0)  # a barrier, then out without the destructors that can deadlock


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="herd's demo training job")
    parser.add_argument("--run-dir", help="where rank 0 writes metrics.jsonl")
    main(run_dir=parser.parse_args().run_dir)
