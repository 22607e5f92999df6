"""Model and optimizer state in one portable form, whatever wraps the model.

Snapshots hold *full*, unwrapped state: keys without DDP's ``module.`` or torch.compile's
``_orig_mod.`` prefixes, tensors unsharded. So a snapshot saved under DDP resumes under FSDP,
under plain python, or with a different number of ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from torchherd.train.errors import SnapshotMismatch

__all__ = [
    "unwrap",
    "model_state",
    "load_model_state",
    "optimizer_state",
    "load_optimizer_state",
    "check_compatible",
]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and torch.compile wrappers (FSDP2 wraps in place)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def _full(everywhere: bool) -> StateDictOptions:
    # cpu_offload=True keeps the gathered copy on rank 0 only; node-scope snapshots need it on
    # every node's writer, so then every rank gathers (more memory, same bytes on disk).
    return StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)


def model_state(model: nn.Module, sharded: bool, everywhere: bool) -> dict[str, Any]:
    """Full model state; with FSDP this is a collective that gathers the shards."""
    if sharded:
        return get_model_state_dict(model, options=_full(everywhere))
    return unwrap(model).state_dict()


def load_model_state(model: nn.Module, state: dict[str, Any], sharded: bool) -> None:
    """Load full state into a model (each rank keeps its own shard under FSDP)."""
    if sharded:
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    else:
        unwrap(model).load_state_dict(state)


def optimizer_state(
    model: nn.Module, optimizer: Optimizer, sharded: bool, everywhere: bool
) -> dict[str, Any]:
    """Full optimizer state. Unsharded optimizers keep torch's own format, which needs no
    collective and never runs the warm-up step that distributed helpers take on empty state."""
    if sharded:
        return get_optimizer_state_dict(model, optimizer, options=_full(everywhere))
    return optimizer.state_dict()


def load_optimizer_state(
    model: nn.Module, optimizer: Optimizer, state: dict[str, Any], sharded: bool
) -> None:
    """Load what ``optimizer_state`` produced."""
    if sharded:
        set_optimizer_state_dict(
            model, optimizer, state, options=StateDictOptions(full_state_dict=True)
        )
    else:
        optimizer.load_state_dict(state)


def _shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def check_compatible(model: nn.Module, saved: dict[str, Any], where: str = "snapshot") -> None:
    """Raise ``SnapshotMismatch`` listing every difference between ``saved`` and the model.

    Shapes are compared as global shapes (a DTensor's ``.shape`` is its unsharded shape), so the
    check needs no collective and works the same under FSDP.
    """
    expected = _shapes(unwrap(model).state_dict())
    found = _shapes(saved)
    missing = tuple(sorted(set(expected) - set(saved)))
    unexpected = tuple(sorted(set(saved) - set(expected)))
    shapes = {
        key: (found[key], expected[key])
        for key in sorted(set(expected) & set(found))
        if found[key] != expected[key]
    }
    if not (missing or unexpected or shapes):
        return
    lines = [f"the {where} was written by a different model:"]
    lines += [f"  missing from {where}: {key}" for key in missing]
    lines += [f"  not in this model: {key}" for key in unexpected]
    lines += [
        f"  shape of {key}: {list(old)} in {where}, {list(new)} in this model"
        for key, (old, new) in shapes.items()
    ]
    raise SnapshotMismatch(
        "\n".join(lines),
        remedy="resume with the model that wrote the snapshot, or use a new run directory",
        missing=missing,
        unexpected=unexpected,
        shape_differences=shapes,
    )
