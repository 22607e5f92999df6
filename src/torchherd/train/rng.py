"""Capture and restore every random-number generator a training step may draw from.

Python's ``random``, NumPy's global generator (when NumPy is installed), torch's CPU generator
and each CUDA device's generator. States are converted to tensors and plain numbers so they
load with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:  # NumPy is optional: only its global generator is saved, and only if it is importable.
    import numpy as np
except ImportError:  # pragma: no cover - exercised only where numpy is absent
    np = None  # type: ignore[assignment]

__all__ = ["get_rng_state", "set_rng_state", "seed_everything"]


def get_rng_state() -> dict[str, Any]:
    """This process's generator states, as tensors, tuples and numbers."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``get_rng_state`` captured; generators it did not capture are left alone."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        saved = state["numpy"]
        np.random.set_state(
            (
                saved["kind"],
                saved["keys"].numpy().astype(np.uint32),
                saved["pos"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )
    if "cuda" in state and torch.cuda.is_available():
        devices = min(len(state["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(state["cuda"][:devices])


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) so a run is reproducible from its start."""
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
