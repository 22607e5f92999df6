"""Test job: an ordinary Hugging Face Trainer script, with no torchherd or distributed code.

Every rank builds its own data (seeded by its rank, as if each node held its own shard). Under
one distributed job the Trainer averages gradients, so every rank ends with the same weights;
run as separate processes each rank would train its own model on its own data. Prints
RESULT rank=R world=W weights=CHECKSUM. Tiny and offline: a 2-layer model from code.
"""

import os

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments


class Pairs(Dataset):
    def __init__(self, seed: int, n: int = 48) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True) + torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


rank = int(os.environ.get("RANK", "0"))
torch.manual_seed(0)  # the same initial weights everywhere
args = TrainingArguments(
    output_dir=os.environ.get("HF_OUT", "hf-out") + f"-{rank}",
    max_steps=4,
    per_device_train_batch_size=4,
    learning_rate=0.05,
    report_to=[],
    save_strategy="no",
    logging_strategy="no",
    disable_tqdm=True,
    dataloader_num_workers=0,
)
trainer = Trainer(model=Regressor(), args=args, train_dataset=Pairs(seed=100 + rank))
trainer.train()
weights = sum(float(p.detach().double().sum()) for p in trainer.model.parameters())
print(f"RESULT rank={rank} world={args.world_size} weights={weights:.10f}", flush=True)
