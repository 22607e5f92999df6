"""A compute-heavy data-parallel job, for the slow-rank watch: an MLP of 4 layers 768 wide on
random data, about a hundred milliseconds of compute per step on one CPU core.

Default: the Trainer of torchherd.train (which reports each rank's compute per step).
--plain: the same model in a hand-written loop, DDP, no torchherd at all (herd then looks at
the ranks instead). Every rank prints `HEAVY rank=R pid=P` once it trains.
--loader-control PATH (Trainer): the batches come through one data-loader worker per rank
(persistent: forked once), which reads PATH ({"rank": R, "batch_s": S}, rewritten at any
time): rank R's loader then takes S seconds a batch, as a slow disk or a slow transform would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

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


class SlowedLoader(Dataset):
    """The dataset as one rank's loader worker reads it: every ``batch_size`` samples, the
    seconds a batch takes that the control file gives this rank (read at most twice a
    second)."""

    def __init__(self, inner: TensorDataset, control: str, batch_size: int) -> None:
        self.inner, self.control, self.batch_size = inner, control, batch_size
        self.count, self.read_at, self.batch_s = 0, 0.0, 0.0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        self.count += 1
        if self.count % self.batch_size == 0:
            now = time.monotonic()
            if now - self.read_at > 0.5:
                self.read_at = now
                try:
                    with open(self.control) as handle:
                        wanted = json.load(handle)
                except (OSError, ValueError):
                    wanted = {}
                mine = str(wanted.get("rank")) == os.environ.get("RANK")
                self.batch_s = float(wanted.get("batch_s", 0.0)) if mine else 0.0
            if self.batch_s:
                time.sleep(self.batch_s)
        return self.inner[index]


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


def trainer(argv: list[str], loader_control: str | None) -> int:
    from torchherd import train

    defaults = {"max_steps": 100000, "batch_size": 128, "log_every": 50, "snapshot_every": 0}
    if loader_control:
        # One worker, kept for the whole run: 8-step epochs would fork one every 1-2 s.
        defaults |= {"num_workers": 1, "persistent_workers": True}
    (config,) = train.parse_config(train.TrainerConfig, argv=argv, defaults=defaults)
    ctx = train.setup()
    dataset = data()
    trainer = train.Trainer(
        model(),
        lambda params: torch.optim.SGD(params, lr=1e-4),
        SlowedLoader(dataset, loader_control, config.batch_size) if loader_control else dataset,
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
    parser.add_argument("--loader-control")
    known, rest = parser.parse_known_args()
    sys.exit(plain(known.steps) if known.plain else trainer(rest, known.loader_control))
