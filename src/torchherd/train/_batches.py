"""Small helpers for whatever a DataLoader yields: tensors, tuples, lists or dicts of them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["to_device", "batch_len", "supervised"]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``; other values pass through."""
    if isinstance(batch, torch.Tensor):
        # non_blocking only helps (and is only safe) from pinned memory to a GPU.
        return batch.to(device, non_blocking=device.type == "cuda")
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_len(batch: Any) -> int:
    """Number of samples in a batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, list | tuple) or isinstance(batch, Mapping):
        for value in values:
            found = batch_len(value)
            if found:
                return found
    return 0


def supervised(
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[nn.Module, Any], torch.Tensor]:
    """A Trainer loss for ``(inputs, targets)`` batches: ``criterion(model(inputs), targets)``."""

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch[0], batch[1]
        return criterion(model(inputs), targets)

    return loss
