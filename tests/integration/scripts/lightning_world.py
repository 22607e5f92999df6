"""Test job: an ordinary Lightning script for 2 nodes x 1 process, with no torchherd code.

Every rank builds its own data (seeded by its rank, as if each node held its own shard). Under
one distributed job DDP averages the gradients, so every rank ends with the same weights; run
as separate processes each rank would train its own model. Prints
RESULT rank=R world=W weights=CHECKSUM. Tiny and offline.
"""

import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


rank = int(os.environ.get("RANK", "0"))
generator = torch.Generator().manual_seed(100 + rank)
inputs = torch.randn(48, 8, generator=generator)
data = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
torch.manual_seed(0)  # the same initial weights everywhere
model = Regressor()
trainer = L.Trainer(
    accelerator="cpu",
    devices=1,
    num_nodes=2,
    strategy="ddp",
    max_steps=4,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,  # each rank keeps its own data
)
trainer.fit(model, DataLoader(data, batch_size=4))
weights = sum(float(p.detach().double().sum()) for p in model.parameters())
print(f"RESULT rank={trainer.global_rank} world={trainer.world_size} weights={weights:.10f}")
