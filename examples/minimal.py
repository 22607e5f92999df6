"""The classic DDP tutorial job (Linear(20, 1) on random data) with torchherd.train.

One process:            python examples/minimal.py --max-steps 100
One machine, 2 workers: torchrun --standalone --nproc-per-node 2 examples/minimal.py --max-steps 100
Every node in herd.toml: herd launch examples/minimal.py --max-steps 100

Kill it at any point and run the same command again: it resumes from the latest snapshot in
<run-dir>/snapshots and reaches the same weights as a run that was never interrupted.
Per-step metrics land in <run-dir>/metrics.jsonl. `--help` lists every option.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from torchherd import train

SAMPLES = 2048
FEATURES = 20


def make_dataset(seed: int) -> TensorDataset:
    """Random inputs and a noisy linear target, identical on every rank for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
    true_weight = torch.randn(FEATURES, 1, generator=generator)
    targets = inputs @ true_weight + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return TensorDataset(inputs, targets)


def main(argv: list[str] | None = None) -> int:
    (config,) = train.parse_config(
        train.TrainerConfig,
        argv=argv,
        defaults={"run_dir": "runs/minimal", "max_steps": 100, "snapshot_every": 20},
        description=__doc__.splitlines()[0],
    )
    ctx = train.setup()
    train.seed_everything(config.seed)  # the same initial weights on every rank
    model = nn.Linear(FEATURES, 1)
    trainer = train.Trainer(
        model,
        lambda params: torch.optim.SGD(params, lr=0.01),
        make_dataset(config.seed),
        train.supervised(nn.MSELoss()),
        config,
        ctx=ctx,
    )
    with trainer:
        trainer.fit()
    train.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
