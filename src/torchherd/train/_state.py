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

from torchherd.train.errors import SnapshotMismatch, TrainError

__all__ = [
    "unwrap",
    "model_state",
    "load_model_state",
    "optimizer_state",
    "load_optimizer_state",
    "check_compatible",
    "own_tensors",
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


def _param_names(model: nn.Module) -> dict[int, str]:
    # named_parameters() lists a tied parameter once, under its first name, as DCP does.
    return {id(param): name for name, param in unwrap(model).named_parameters()}


def optimizer_state(
    model: nn.Module, optimizer: Optimizer, sharded: bool, everywhere: bool
) -> dict[str, Any]:
    """Full optimizer state keyed by parameter names (DCP's format), whatever the wrapper.

    Unsharded optimizers are converted by hand: it needs no collective, and DCP's helper would
    run a warm-up step on an optimizer that has no state yet, changing what it resumes.
    """
    if sharded:
        return get_optimizer_state_dict(model, optimizer, options=_full(everywhere))
    names = _param_names(model)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    unnamed = [index for index, param in enumerate(params) if id(param) not in names]
    if unnamed:
        raise TrainError(
            f"the optimizer holds {len(unnamed)} tensor(s) that are not parameters of the model",
            remedy="build the optimizer from model.parameters() (or a factory given them)",
        )
    name_of = [names[id(param)] for param in params]
    native = optimizer.state_dict()
    return {
        "state": {name_of[index]: value for index, value in native["state"].items()},
        "param_groups": [
            {**group, "params": [name_of[index] for index in group["params"]]}
            for group in native["param_groups"]
        ],
    }


def load_optimizer_state(
    model: nn.Module, optimizer: Optimizer, state: dict[str, Any], sharded: bool
) -> None:
    """Load what ``optimizer_state`` produced, under any wrapper; KeyError/ValueError when the
    snapshot's parameters or groups do not match this optimizer's."""
    if sharded:
        set_optimizer_state_dict(
            model, optimizer, state, options=StateDictOptions(full_state_dict=True)
        )
        return
    names = _param_names(model)
    current = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    saved = state["param_groups"]
    if len(saved) != len(current):
        raise ValueError(f"{len(saved)} parameter groups in the snapshot, {len(current)} here")
    index: dict[str, int] = {}
    groups = []
    for number, (here, there) in enumerate(zip(current, saved, strict=True)):
        if set(here) != set(there["params"]):
            raise ValueError(f"parameter group {number} holds different parameters")
        # Positions follow this optimizer's order, which is how load_state_dict pairs them.
        ids = list(range(len(index), len(index) + len(here)))
        index.update(zip(here, ids, strict=True))
        groups.append({**there, "params": ids})
    native_state = {index[name]: value for name, value in state["state"].items()}
    optimizer.load_state_dict({"state": native_state, "param_groups": groups})


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


def own_tensors(state: Any) -> None:
    """Replace every tensor in the dicts of ``state`` (an optimizer's ``state``) by a copy
    in memory of its own, one at a time: loaded tensors map the snapshot file, whose pages
    must not stay mapped (a pruned snapshot's space would never be freed)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.clone()
            else:
                own_tensors(value)
