"""A compute-heavy data-parallel job, for the slow-rank watch: an MLP of 4 layers 768 wide on
random data, about a hundred milliseconds of compute per step on one CPU core.

Default: the Trainer of torchherd.train (which reports each rank's compute per step).
--plain: the same model in a hand-written loop, DDP, no torchherd at all (herd then looks at
the ranks instead). Every rank prints `HEAVY rank=R pid=P` once it trains.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

WIDTH = 768


def model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 1))


def data(samples: int = 8192) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(samples, WIDTH, generator=generator)
    return TensorDataset(inputs, inputs[:, :1].clone())


def announce() -> None:
    print(f"HEAVY rank={os.environ.get('RANK')} pid={os.getpid()}", flush=True)


def plain(steps: int) -> int:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    net = DistributedDataParallel(model())
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-4)
    inputs, targets = data().tensors
    announce()
    for step in range(steps):
        start = (step * 128) % (len(inputs) - 128)
        loss = nn.functional.mse_loss(
            net(inputs[start : start + 128]), targets[start : start + 128]
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def trainer(argv: list[str]) -> int:
    from torchherd import train

    (config,) = train.parse_config(
        train.TrainerConfig,
        argv=argv,
        defaults={"max_steps": 100000, "batch_size": 128, "log_every": 50, "snapshot_every": 0},
    )
    ctx = train.setup()
    trainer = train.Trainer(
        model(),
        lambda params: torch.optim.SGD(params, lr=1e-4),
        data(),
        train.supervised(nn.MSELoss()),
        config,
        ctx=ctx,
    )
    announce()
    with trainer:
        trainer.fit()
    train.teardown()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--steps", type=int, default=100000)
    known, rest = parser.parse_known_args()
    sys.exit(plain(known.steps) if known.plain else trainer(rest))
