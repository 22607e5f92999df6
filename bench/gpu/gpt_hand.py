"""The hand-written training loop the GPU check sets next to examples/gpt.py's Trainer.

    herd launch bench/gpu/gpt_hand.py [the same options as examples/gpt.py] [--warmup-steps N]

Same model (imported from examples/gpt.py), data, batch, optimizer, schedule, precision,
clipping and compile setting; DDP when there is more than one rank; the loss read every
``--log-every`` steps, as such loops print it. After ``--warmup-steps`` (compilation, cuDNN and
allocator warm-up) the remaining steps are timed between two device synchronisations. Rank 0
prints one line ``HERD_GPU_HAND {json}``: tokens/s and what the check computes MFU from (FLOPs
and tokens per sample, the GPU and its peak, as torchherd.train's metrics know them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from torchherd import train
from torchherd.train.metrics import peak_flops

MARKER = "HERD_GPU_HAND "
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"


@dataclass(kw_only=True, slots=True)
class HandConfig:
    """What only the hand-written loop needs."""

    warmup_steps: int = 20
    """Steps before the timed ones (compilation and warm-up)."""


def load_example() -> ModuleType:
    """examples/gpt.py as a module (registered first: its dataclasses look themselves up)."""
    spec = importlib.util.spec_from_file_location("herd_gpt_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> int:
    gpt = load_example()
    config, gpt_config, hand = train.parse_config(
        train.TrainerConfig, gpt.GPTConfig, HandConfig, argv=argv, defaults={"max_steps": 60}
    )
    steps = config.max_steps or 0
    if not 0 < hand.warmup_steps < steps:
        raise SystemExit(f"--warmup-steps must be between 1 and --max-steps - 1, got {steps}")
    ctx = train.setup()
    train.seed_everything(config.seed)
    alphabet, ids, split = gpt.encode(gpt_config)
    model = gpt.build_model(gpt_config, len(alphabet)).to(ctx.device)
    distributed = ctx.world_size > 1
    ids_arg = [ctx.device] if ctx.device.type == "cuda" else None
    module = DistributedDataParallel(model, device_ids=ids_arg) if distributed else model
    optimizer = torch.optim.AdamW(module.parameters(), lr=gpt_config.lr, weight_decay=0.1)
    total = gpt_config.decay_steps or steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, gpt.cosine(total))
    data = gpt.CharWindows(ids[:split], gpt_config.block_size)
    sampler = (
        DistributedSampler(data, seed=config.seed)
        if distributed
        else RandomSampler(data, generator=torch.Generator().manual_seed(config.seed))
    )
    loader = DataLoader(
        data,
        batch_size=config.batch_size,
        sampler=sampler,
        pin_memory=ctx.device.type == "cuda",
        drop_last=True,
    )
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
    autocast: Any = (
        (lambda: torch.autocast(device_type=ctx.device.type, dtype=dtype))
        if dtype
        else contextlib.nullcontext
    )

    def batches() -> Any:
        epoch = 0
        while True:
            if isinstance(sampler, DistributedSampler):
                sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream = batches()
    module.train()
    started = 0.0
    for step in range(1, steps + 1):
        if step == hand.warmup_steps + 1:
            _sync(ctx.device)
            started = time.perf_counter()
        inputs, targets = (t.to(ctx.device, non_blocking=True) for t in next(stream))
        with autocast():
            loss = gpt.language_model_loss(module, (inputs, targets))
        loss.backward()
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step % config.log_every == 0 and ctx.is_main:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    _sync(ctx.device)
    elapsed = time.perf_counter() - started
    timed = steps - hand.warmup_steps
    samples_per_s = timed * config.batch_size * ctx.world_size / elapsed
    peak = peak_flops(ctx.device)
    flops = model.flops_per_sample()
    if ctx.is_main:
        answer = {
            "steps": timed,
            "seconds": elapsed,
            "world_size": ctx.world_size,
            "tokens_per_s": samples_per_s * model.tokens_per_sample(),
            "flops_per_sample": flops,
            "tokens_per_sample": model.tokens_per_sample(),
            "device": _device_name(ctx.device),
            "peak_flops": peak,
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        print(MARKER + json.dumps(answer), flush=True)
    train.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
