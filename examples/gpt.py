"""A small character-level GPT on examples/data/tiny.txt, trained with torchherd.train.

One process:            python examples/gpt.py --max-steps 200
One machine, 2 workers: torchrun --standalone --nproc-per-node 2 examples/gpt.py --max-steps 200
Every node in herd.toml: herd launch examples/gpt.py --max-steps 2000 --precision bf16

Add --parallel fsdp to shard it (each transformer block is an FSDP unit), --compile true to
compile its blocks (GPT-2 small: --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024
--dropout 0 --precision bf16, as scripts/gpu-check runs it). Kill it and rerun the
same command: it resumes from the latest snapshot. Metrics go to <run-dir>/metrics.jsonl, with
tokens/s, and MFU on A100/H100/H200. `--help` lists every option.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from torchherd import train

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "tiny.txt"


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Model and data settings of this example."""

    text: str = str(DEFAULT_TEXT)
    """Text file to learn from (characters are the tokens)."""
    block_size: int = 64
    """Context length in characters."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 64
    """Width of the residual stream."""
    dropout: float = 0.1
    """Dropout probability in attention and MLP outputs."""
    lr: float = 3e-3
    """Peak learning rate of AdamW (cosine decay to 10% over decay_steps)."""
    decay_steps: int | None = None
    """Steps of the LR decay (default: max_steps); keep it fixed across resumes."""
    eval_fraction: float = 0.1
    """Share of the text held out for evaluation."""
    compile: bool = False
    """Compile each transformer block with torch.compile (GPUs need Triton; CPUs a C++ compiler)."""


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every window of ``block_size + 1`` characters: input and the next-character target."""

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids = ids
        self.block_size = block_size

    def __len__(self) -> int:
        return max(len(self.ids) - self.block_size, 0)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[index : index + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        heads = [t.view(batch, length, self.n_head, -1).transpose(1, 2) for t in (q, k, v)]
        attended = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.drop(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """A tiny GPT that reports its FLOPs per sample, so the Trainer can show MFU."""

    def __init__(self, cfg: GPTConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(vocab_size, cfg.n_embd)
        self.positions = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.head.weight = self.tokens.weight  # weight tying, as in GPT-2
        for module in self.modules():
            # GPT-2's init: small weights keep the first logits near uniform (loss ~ ln vocab).
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tokens(ids) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def tokens_per_sample(self) -> int:
        return self.cfg.block_size

    def flops_per_sample(self) -> float:
        # PaLM's estimate (as in nanoGPT): 6 FLOPs per parameter per token for forward and
        # backward, plus attention's 12 * layers * width * context per token.
        params = sum(p.numel() for p in self.parameters()) - self.positions.weight.numel()
        cfg = self.cfg
        per_token = 6 * params + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
        return float(per_token * cfg.block_size)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, count: int) -> torch.Tensor:
        for _ in range(count):
            logits = self(ids[:, -self.cfg.block_size :])[:, -1]
            ids = torch.cat([ids, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return ids


def language_model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def encode(cfg: GPTConfig) -> tuple[list[str], torch.Tensor, int]:
    """The text's characters (the vocabulary), the text as their ids, and where the held-out
    part starts."""
    text = Path(cfg.text).read_text(encoding="utf-8")
    alphabet = sorted(set(text))
    ids = torch.tensor([alphabet.index(c) for c in text], dtype=torch.long)
    return alphabet, ids, int(len(ids) * (1 - cfg.eval_fraction))


def build_model(cfg: GPTConfig, vocab_size: int) -> GPT:
    model = GPT(cfg, vocab_size)
    if cfg.compile:
        # Block by block, as torchtitan does: the model keeps its class, its state-dict keys
        # and its FSDP units, so snapshots and --parallel fsdp work as without compiling.
        for block in model.blocks:
            block.compile()
    return model


def cosine(total: int) -> Callable[[int], float]:
    """The learning-rate factor: cosine from 1 down to 0.1 over ``total`` steps, then 0.1."""
    return lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * min(step / total, 1)))


def main(argv: list[str] | None = None) -> int:
    config, gpt_config = train.parse_config(
        train.TrainerConfig,
        GPTConfig,
        argv=argv,
        defaults={
            "run_dir": "runs/gpt",
            "max_steps": 200,
            "batch_size": 16,
            "snapshot_every": 50,
            "eval_every": 50,
            "max_grad_norm": 1.0,
        },
        description=__doc__.splitlines()[0],
    )
    ctx = train.setup()
    train.seed_everything(config.seed)
    alphabet, ids, split = encode(gpt_config)
    model = build_model(gpt_config, len(alphabet))
    # The schedule's horizon is part of the run: a resume with another --max-steps and no
    # --decay-steps would follow a different curve from the snapshot on.
    total = gpt_config.decay_steps or config.max_steps or 1000

    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, cosine(total))

    trainer = train.Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=gpt_config.lr, weight_decay=0.1),
        CharWindows(ids[:split], gpt_config.block_size),
        language_model_loss,
        config,
        scheduler=schedule,
        eval_dataset=CharWindows(ids[split:], gpt_config.block_size),
        ctx=ctx,
    )
    with trainer:
        trainer.fit()
        if ctx.is_main and config.parallel != "fsdp":  # FSDP would need every rank to generate
            prompt = ids[:1].view(1, 1).to(ctx.device)
            trainer.module.eval()
            sample = trainer.module.generate(prompt, 120)[0].tolist()
            print("sample: " + "".join(alphabet[i] for i in sample).replace("\n", " "))
    train.teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
