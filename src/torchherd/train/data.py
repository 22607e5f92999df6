"""A distributed sampler that resumes mid-epoch, even when the number of ranks changes.

The order of an epoch is one global permutation that depends only on (seed, epoch), never on
the world size. The state is the epoch and how many samples of it the whole job has consumed;
on every (re)start the samples not yet consumed are dealt out to the ranks round-robin
(rank r takes remaining[r::world]). Because ranks move in lockstep, after each rank has taken k
samples the job has consumed exactly the first k * world of the remaining ones, so a snapshot
taken at any step resumes with no sample of the epoch repeated or skipped, with 2 ranks or 200.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from torchherd.train.dist import current_context
from torchherd.train.errors import TrainError

__all__ = ["ResumableSampler"]


class ResumableSampler(Sampler[int]):
    """Yields this rank's share of the epoch's indices, starting where the job left off.

    Tell it what was consumed with ``advance(n)`` (samples this rank used in a step): the
    sampler cannot know by itself, since a DataLoader's workers read ahead of training.
    With ``drop_last=False`` the last round is padded by repeating the epoch's first samples so
    every rank takes the same number of steps (as ``DistributedSampler`` does); with
    ``drop_last=True`` fewer than ``world_size`` samples at the end of an epoch are skipped.
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        if rank is None or world_size is None:
            ctx = current_context()
            rank = ctx.rank if rank is None else rank
            world_size = ctx.world_size if world_size is None else world_size
        if world_size < 1 or not 0 <= rank < world_size:
            raise TrainError(f"rank {rank} is not in a world of size {world_size}")
        self.dataset_size = len(dataset)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.consumed = 0
        """Samples of the current epoch consumed by the whole job (all ranks together)."""

    # ------------------------------------------------------------------------ order

    def epoch_order(self, epoch: int | None = None) -> list[int]:
        """The global order of an epoch: identical on every rank and for every world size."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def _remaining_global(self) -> list[int]:
        order = self.epoch_order()
        remaining = order[min(self.consumed, len(order)) :]
        if self.drop_last:
            usable = len(remaining) - len(remaining) % self.world_size
            return remaining[:usable]
        short = -len(remaining) % self.world_size
        if short and order:
            # Repeat from the epoch's start (cycling when the dataset is tiny) to even out.
            padding = (order * (short // len(order) + 1))[:short]
            remaining = remaining + padding
        return remaining

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining_global()[self.rank :: self.world_size])

    def __len__(self) -> int:
        remaining = max(self.dataset_size - self.consumed, 0)
        if self.drop_last:
            return remaining // self.world_size
        return -(-remaining // self.world_size)

    # ------------------------------------------------------------------------ progress

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``; a new epoch starts from its first sample, the current one stays."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed = 0

    def advance(self, local_samples: int) -> None:
        """Record that this rank consumed ``local_samples`` more (and so did every other rank)."""
        if local_samples < 0:
            raise TrainError(f"cannot advance a sampler by {local_samples} samples")
        self.consumed = min(self.consumed + local_samples * self.world_size, self.dataset_size)

    @property
    def epoch_done(self) -> bool:
        """True when this rank has nothing left to take in the current epoch."""
        return len(self) == 0

    # ------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Position in the data, independent of the world size (safe to restore on any)."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_size": self.dataset_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; refuses a position from a different dataset or order."""
        if state.get("dataset_size") != self.dataset_size:
            raise TrainError(
                f"sampler state is for a dataset of {state.get('dataset_size')} samples, "
                f"this one has {self.dataset_size}",
                remedy="resume with the same dataset, or start a new run directory",
            )
        if state.get("seed") != self.seed or state.get("shuffle") != self.shuffle:
            raise TrainError(
                "sampler state was saved with a different seed or shuffle setting",
                remedy="keep seed and shuffle unchanged when resuming",
            )
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
