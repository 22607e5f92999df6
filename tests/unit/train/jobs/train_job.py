"""A training job for the tests, run under real torchrun: it exercises everything exact resume
must restore (dropout draws from the RNG, AdamW state, an LR schedule, gradient accumulation,
clipping, data order) and can record which samples each rank consumed at each step.

    torchrun --standalone --nproc-per-node 2 train_job.py --run-dir D --max-steps 20 \
        --snapshot-every 4 [--step-sleep 0.2] [--record-indices] [--log-every 4 --say-steps]

--say-steps: rank 0 prints `SAY step N` as step N begins, among the Trainer's progress lines.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from torchherd import train


class IndexedData(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Fixed random regression data that also returns each sample's index."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.inputs = torch.randn(size, 16, generator=generator)
        self.targets = self.inputs.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.inputs[index], self.targets[index], index


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--snapshot-every", type=int, default=4)
    parser.add_argument("--dataset-size", type=int, default=640)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum-steps", type=int, default=2)
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--record-indices", action="store_true")
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--say-steps", action="store_true")
    parser.add_argument("--parallel", default="auto", choices=["auto", "ddp", "fsdp", "none"])
    parser.add_argument(
        "--draw-every-rng", action="store_true", help="the loss draws from random and numpy too"
    )
    args = parser.parse_args()

    ctx = train.setup()
    config = train.TrainerConfig(
        run_dir=args.run_dir,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        snapshot_every=args.snapshot_every,
        batch_size=args.batch_size,
        grad_accum_steps=args.grad_accum_steps,
        drop_last=args.drop_last,
        max_grad_norm=1.0,
        # By default every step, so a killed run has written what it did.
        log_every=args.log_every,
        parallel=args.parallel,
    )
    train.seed_everything(config.seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
    record = Path(args.run_dir) / f"indices-rank{ctx.rank}.jsonl"
    state: dict[str, Any] = {}

    def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets, indices = batch
        step = state["trainer"].step + 1
        if args.say_steps and ctx.is_main and state.get("said") != step:
            state["said"] = step
            print(f"SAY step {step}", flush=True)
        if args.record_indices:
            with open(record, "a", encoding="utf-8") as out:
                line = {"step": step, "indices": indices.tolist()}
                out.write(json.dumps(line) + "\n")
        if args.step_sleep:
            time.sleep(args.step_sleep)
        loss = nn.functional.mse_loss(module(inputs), targets)
        if args.draw_every_rng:
            # Augmentation-like draws from every generator a script may use: a resume that
            # restored any of them wrongly changes the loss of every later step.
            loss = loss * (1 + 0.01 * random.random()) + 0.01 * float(np.random.rand())
            loss = loss + 0.01 * torch.rand(()).item()
        return loss

    trainer = train.Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=1e-2),
        IndexedData(args.dataset_size),
        loss_fn,
        config,
        scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7),
        ctx=ctx,
    )
    state["trainer"] = trainer
    with trainer:
        result = trainer.fit()
    if ctx.is_main:
        print(f"RESULT resumed_from={result.resumed_from} step={result.step}", flush=True)
    train.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
