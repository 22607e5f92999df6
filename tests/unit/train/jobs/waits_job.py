"""A two-rank Trainer job on CPU/Gloo for the wait timer: rank 1 sleeps --lag seconds in every
forward pass, in its data loader (--where data) or in its loss (--where step); every beat's
timings go to <out>/beats-R.jsonl (progress.beat wrapped: what herd's agent would read)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from torchherd import progress, train


class Slow(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, lag: float) -> None:
        generator = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(4096, 64, generator=generator)
        self.lag = lag

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lag and index % 32 == 0:  # once a batch
            time.sleep(self.lag)
        return self.inputs[index], self.inputs[index, :1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--lag", type=float, default=0.0)
    parser.add_argument("--where", choices=("data", "step"), default="step")
    args, rest = parser.parse_known_args()
    rank = int(os.environ["RANK"])
    lag = args.lag if rank == 1 else 0.0
    records = open(os.path.join(args.out, f"beats-{rank}.jsonl"), "w")  # noqa: SIM115
    original = progress.beat

    def beat(step=None, compute=None, now=False, **timings):  # type: ignore[no-untyped-def]
        if timings.get("wait") is not None:
            records.write(json.dumps(timings) + "\n")
        original(step, compute, now, **timings)

    progress.beat = beat  # type: ignore[assignment]

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if lag and args.where == "step":
            time.sleep(lag)
        inputs, targets = batch
        return nn.functional.mse_loss(model(inputs), targets)

    (config,) = train.parse_config(
        train.TrainerConfig,
        argv=rest,
        defaults={"max_steps": 60, "batch_size": 32, "snapshot_every": 0, "log_every": 1000},
    )
    ctx = train.setup()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    trainer = train.Trainer(
        model,
        lambda p: torch.optim.SGD(p, lr=1e-3),
        Slow(lag if args.where == "data" else 0.0),
        loss,
        config,
        ctx=ctx,
    )
    with trainer:
        trainer.fit()
    records.close()
    train.teardown()


if __name__ == "__main__":
    main()
